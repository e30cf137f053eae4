/* memfit model page: a chat box that streams from /v1/chat/completions (the same endpoint the API's
   clients call; the page's session cookie authenticates it), reading OpenAI's server-sent chunks. */
(function () {
  "use strict";
  var form = document.getElementById("chat-form");
  if (!form) return;
  var model = form.getAttribute("data-model");
  var log = document.getElementById("chat-log");
  var input = document.getElementById("chat-input");
  var history = [];
  var state = (window.memfitChat = { streaming: false, chunks: 0, last: "", error: null });

  function line(role, text) {
    var p = document.createElement("p");
    p.className = "chat-" + role;
    var b = document.createElement("b");
    b.textContent = role + ": ";
    var span = document.createElement("span");
    span.textContent = text;
    p.appendChild(b);
    p.appendChild(span);
    log.appendChild(p);
    return span;
  }

  form.addEventListener("submit", function (ev) {
    ev.preventDefault();
    var text = input.value.trim();
    if (!text || state.streaming) return;
    input.value = "";
    history.push({ role: "user", content: text });
    line("user", text);
    var out = line("assistant", "");
    state.streaming = true; state.chunks = 0; state.last = ""; state.error = null;
    fetch("/v1/chat/completions", {
      method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: model, messages: history, stream: true, max_tokens: 64, temperature: 0 })
    }).then(function (r) {
      if (!r.ok) return r.json().then(function (e) { throw new Error(e.error ? e.error.message : r.statusText); });
      var reader = r.body.getReader(), decoder = new TextDecoder(), buffer = "";
      function pump() {
        return reader.read().then(function (res) {
          if (res.done) return;
          buffer += decoder.decode(res.value, { stream: true });
          var events = buffer.split("\n\n");
          buffer = events.pop();
          events.forEach(function (e) {
            var data = e.replace(/^data: /, "");
            if (!data || data === "[DONE]") return;
            var chunk = JSON.parse(data);
            if (chunk.error) { state.error = chunk.error.message; return; }
            var c = chunk.choices && chunk.choices[0];
            if (c && c.delta && c.delta.content) { out.textContent += c.delta.content; state.chunks++; }
          });
          return pump();
        });
      }
      return pump();
    }).catch(function (e) { state.error = String(e.message || e); out.textContent = "(" + state.error + ")"; })
      .then(function () {
        state.last = out.textContent; state.streaming = false;
        history.push({ role: "assistant", content: out.textContent });
      });
  });
})();
