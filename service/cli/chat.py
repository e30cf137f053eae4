"""`memfit chat MODEL`: talk to a model memfit serves (a base preset, a job's ``ft:`` model or a checkpoint's)
from a terminal, its answer streamed as it is generated from ``POST /v1/chat/completions`` — the endpoint
the API's clients call. ``--message`` asks once and exits (scripts); without it, a conversation until EOF.
``memfit models`` lists what may be called.
"""

from __future__ import annotations

import json
import sys
from typing import Iterator

import httpx
import typer

from service.cli.client import ApiError, ApiKey, ApiUrl, Json, _fail, call, client, console, err


def stream_chat(http: httpx.Client, model: str, messages: list[dict], *, max_tokens: int, temperature: float) -> Iterator[str]:
    """The answer's text pieces as the server sends them (OpenAI's chat.completion.chunk events)."""
    body = {"model": model, "messages": messages, "stream": True, "max_tokens": max_tokens, "temperature": temperature}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code >= 400:
            r.read()
            try:
                raise ApiError(r.status_code, r.json())
            except ValueError:
                raise ApiError(r.status_code, r.text) from None
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if chunk.get("error"):
                raise ApiError(500, {"detail": chunk["error"].get("message")})
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    yield piece


def chat(model: str = typer.Argument(..., help="A model id from `memfit models`."),
         message: str = typer.Option(None, "--message", "-m", help="Ask this once and exit."),
         system: str = typer.Option(None, "--system", help="A system message first."),
         max_tokens: int = typer.Option(256, help="The most tokens an answer may have."),
         temperature: float = typer.Option(0.0, help="0: greedy."),
         api_url: str = ApiUrl, api_key: str = ApiKey) -> None:
    """Chat with a served model, its answers streamed."""
    http = client(api_url, api_key, timeout=300)
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    interactive = message is None
    while True:
        if interactive:
            try:
                text = input("> ")
            except EOFError:
                return
            if not text.strip():
                continue
        else:
            text = message
        messages.append({"role": "user", "content": text})
        answer = []
        try:
            for piece in stream_chat(http, model, messages, max_tokens=max_tokens, temperature=temperature):
                answer.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except ApiError as exc:
            _fail(exc)
        except httpx.HTTPError as exc:
            err.print(f"[red]error:[/red] cannot reach {http.base_url}: {exc}")
            raise typer.Exit(2) from None
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(answer)})
        if not interactive:
            return


def models(api_url: str = ApiUrl, api_key: str = ApiKey, as_json: bool = Json) -> None:
    """The models this tenant may call."""
    try:
        data = call(client(api_url, api_key), "GET", "/v1/models")
    except ApiError as exc:
        _fail(exc)
    if as_json:
        console.print_json(json.dumps(data))
        return
    for m in data["data"]:
        console.print(f"{m['id']}  [dim]{m['owned_by']}[/dim]", highlight=False)
