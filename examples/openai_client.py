"""Talk to a running `pagewire serve` with the official openai SDK (streamed chat + a completion).

Usage:
    make serve            # in another terminal
    .venv/bin/pip install openai && .venv/bin/python examples/openai_client.py
"""
from __future__ import annotations

from openai import OpenAI


def main() -> None:
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello in three words."}],
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n[usage] {chunk.usage}")
    done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=0)
    print(f"[completion] {done.choices[0].text!r} finish_reason={done.choices[0].finish_reason}")


if __name__ == "__main__":
    main()
