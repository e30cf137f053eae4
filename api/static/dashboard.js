/* memfit dashboard: draws the job page's charts from the JSON embedded in the page and keeps them
   live from the job's Server-Sent Events stream (no reload). Chart objects are exposed on
   window.memfitCharts so tests (and curious users) can read the rendered datasets. */
(function () {
  "use strict";
  var holder = document.getElementById("page-data");
  if (!holder || !document.getElementById("job-header")) return;
  var data = JSON.parse(holder.textContent);
  var job = data.job;
  var TERMINAL = { succeeded: 1, failed: 1, cancelled: 1 };
  var COLORS = { parameters: "#4e79a7", gradients: "#f28e2b", optimizer_states: "#e15759",
                 activations: "#59a14f", other: "#b07aa1" };
  var charts = (window.memfitCharts = { loss: null, throughput: null, memory: {} });
  var live = (window.memfitLive = { connected: false, received: 0, ended: false, memoryUpdates: 0 });

  function fmtBytes(n) {
    if (n === null || n === undefined) return "—";
    var u = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
    while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + u[i];
  }
  Chart.defaults.animation = false;
  Chart.defaults.font.size = 11;

  // --- loss and throughput ---------------------------------------------------------------------
  var m = data.metrics;
  charts.loss = new Chart(document.getElementById("chart-loss"), {
    type: "line",
    data: { labels: m.steps.slice(), datasets: [
      { label: "training loss", data: m.loss.slice(), borderColor: "#4e79a7", pointRadius: 2, tension: 0.2 },
      { label: "validation loss", data: m.eval_loss.slice(), borderColor: "#e15759", pointRadius: 3, spanGaps: true, showLine: true }
    ] },
    options: { responsive: true, scales: { x: { title: { display: true, text: "step" } } } }
  });
  charts.throughput = new Chart(document.getElementById("chart-throughput"), {
    type: "line",
    data: { labels: m.steps.slice(), datasets: [
      { label: "tokens/s (rank 0)", data: m.tokens_per_s.slice(), borderColor: "#59a14f", pointRadius: 2 }
    ] },
    options: { responsive: true, scales: { x: { title: { display: true, text: "step" } } } }
  });

  function upsertStep(chart, step, values) {
    var i = chart.data.labels.indexOf(step);
    if (i < 0) {
      i = chart.data.labels.length;
      while (i > 0 && chart.data.labels[i - 1] > step) i--;
      chart.data.labels.splice(i, 0, step);
      chart.data.datasets.forEach(function (ds, k) { ds.data.splice(i, 0, values[k]); });
    } else {
      chart.data.datasets.forEach(function (ds, k) { ds.data[i] = values[k]; });
    }
    chart.update("none");
  }

  // --- memory per rank (stacked) ----------------------------------------------------------------
  var mem = data.memory;
  var lastMemId = mem.last_sample_id || 0;

  function memoryChart(rank) {
    if (charts.memory[rank]) return charts.memory[rank];
    var canvas = document.getElementById("chart-memory-" + rank);
    if (!canvas) {
      var empty = document.getElementById("memory-empty");
      if (empty) empty.remove();
      var box = document.createElement("div");
      box.className = "rank-chart"; box.dataset.rank = rank;
      box.innerHTML = "<h3>rank " + rank + "</h3>";
      canvas = document.createElement("canvas");
      canvas.id = "chart-memory-" + rank; canvas.height = 240;
      box.appendChild(canvas);
      document.getElementById("memory-charts").appendChild(box);
    }
    // One stacked bar per sampled step: the counters (parameters, gradients, optimizer states) are
    // there every step, activations and temporaries on the steps the profiler traced.
    var datasets = mem.categories.map(function (c) {
      return { type: "bar", label: mem.labels[c], category: c, data: [], stack: "measured",
               borderColor: COLORS[c], backgroundColor: COLORS[c] + "cc", borderWidth: 0,
               categoryPercentage: 0.9, barPercentage: 1.0 };
    });
    // The plan of each step's own micro-batches, drawn under the measured bars (service/memory/step_compare.py).
    datasets.push({ type: "line", label: "predicted (this step's micro-batches)", category: "predicted", data: [],
                    stack: "predicted", fill: false, borderColor: "#555", borderWidth: 2, pointRadius: 0,
                    spanGaps: true, order: -1 });
    if (mem.capacity_bytes) {
      datasets.push({ type: "line", label: mem.capacity_label, category: "capacity", data: [], stack: "capacity",
                      fill: false, borderColor: "#222", borderDash: [6, 4], pointRadius: 0, borderWidth: 2 });
    }
    var chart = new Chart(canvas, {
      type: "bar",
      data: { labels: [], datasets: datasets },
      options: {
        responsive: true,
        interaction: { mode: "index", intersect: false },
        plugins: { tooltip: { callbacks: { label: function (c) { return c.dataset.label + ": " + fmtBytes(c.parsed.y); } } } },
        scales: {
          x: { stacked: true, title: { display: true, text: "step" } },
          y: { stacked: true, beginAtZero: true, ticks: { callback: function (v) { return fmtBytes(v); } } }
        }
      }
    });
    charts.memory[rank] = chart;
    return chart;
  }

  function addSamples(samples) {
    var touched = {};
    samples.forEach(function (s) {
      var chart = memoryChart(s.rank);
      chart.data.labels.push(s.step);
      chart.data.datasets.forEach(function (ds) {
        ds.data.push(ds.category === "capacity" ? mem.capacity_bytes : s[ds.category]);
      });
      touched[s.rank] = chart;
      if (s.id > lastMemId) lastMemId = s.id;
    });
    Object.keys(touched).forEach(function (r) {
      var chart = touched[r];
      var cap = chart.data.datasets.find(function (d) { return d.category === "capacity"; });
      if (cap) {
        // A capacity hundreds of times the measured bytes (tiny CPU models) would flatten the
        // stack to nothing: keep the line in the legend, hidden until clicked.
        var top = 0;
        chart.data.labels.forEach(function (_, i) {
          var sum = 0;
          chart.data.datasets.forEach(function (d) { if (d.stack === "measured") sum += d.data[i] || 0; });
          top = Math.max(top, sum);
        });
        cap.hidden = top > 0 && mem.capacity_bytes > 20 * top;
      }
      chart.update("none");
    });
  }
  addSamples(mem.samples);

  var memTimer = null;
  function refreshMemory() {
    if (memTimer) return;
    memTimer = setTimeout(function () {
      memTimer = null;
      fetch("/ui/jobs/" + job.id + "/memory.json?after_id=" + lastMemId, { credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (body) {
          if (!body) return;
          var fresh = body.samples.filter(function (s) { return s.id > lastMemId; });
          if (fresh.length) { addSamples(fresh); live.memoryUpdates += 1; }
        });
    }, 150);
  }

  // --- live updates from the SSE stream --------------------------------------------------------
  var statusEl = document.getElementById("job-status");
  function setStatus(s) {
    statusEl.textContent = s;
    statusEl.className = "badge " + s;
    job.status = s;
  }
  function progress(d) {
    if (!d.total_steps) return;
    document.getElementById("progress-fill").style.width = (100 * d.step / d.total_steps).toFixed(1) + "%";
    document.getElementById("progress-text").textContent = "step " + d.step + "/" + d.total_steps;
    if (d.tokens_per_s) document.getElementById("tokens-text").textContent = Math.round(d.tokens_per_s) + " tokens/s";
    if (d.step_time_s && d.total_steps > d.step) {
      document.getElementById("eta-text").textContent = "ETA " + Math.round((d.total_steps - d.step) * d.step_time_s) + " s";
    }
  }
  var eventsBody = document.querySelector("#events tbody");
  var seen = {};
  data.events.forEach(function (e) { seen[e.id] = 1; });
  function addEventRow(id, e) {
    var tr = document.createElement("tr");
    tr.className = "event " + e.level + " " + e.type + " fresh";
    tr.dataset.eventId = id;
    var td = document.createElement("td");
    td.textContent = e.message;
    tr.appendChild(td);
    eventsBody.insertBefore(tr, eventsBody.firstChild);
  }

  if (!TERMINAL[job.status]) {
    var es = new EventSource("/v1/fine_tuning/jobs/" + job.id + "/events/stream?last_event_id=" + (data.last_event_id || 0));
    window.memfitStream = es;
    es.onopen = function () { live.connected = true; };
    es.onmessage = function (msg) {
      var id = parseInt(msg.lastEventId, 10);
      if (seen[id]) return;
      seen[id] = 1;
      live.received += 1;
      var e = JSON.parse(msg.data);
      addEventRow(id, e);
      var d = e.data || {};
      if (e.type === "metrics") {
        if ((d.rank || 0) === 0 && d.step !== undefined) {
          upsertStep(charts.loss, d.step, [d.train_loss === undefined ? null : d.train_loss,
                                           d.valid_loss === undefined ? null : d.valid_loss]);
          upsertStep(charts.throughput, d.step, [d.tokens_per_s === undefined ? null : d.tokens_per_s]);
          progress(d);
        }
        refreshMemory();
      } else if (d.status) {
        setStatus(d.status);
      }
    };
    es.addEventListener("end", function (msg) {
      live.ended = true;
      es.close();
      var body = JSON.parse(msg.data);
      if (body.status) setStatus(body.status);
      document.getElementById("live-state").textContent = "finished";
      refreshMemory();
    });
  }
})();
