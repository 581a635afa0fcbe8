"""JetFlow: lossless speculative decoding with a causal parallel tree draft head.

    import jetflow
    jf = jetflow.JetFlow.from_pretrained("smollm2-135m-instruct", drafter="path/to/drafter")
    print(jf.generate("What is 7 * 8?", max_new_tokens=64).text)
"""

__version__ = "0.1.0"

_LAZY = {
    "JetFlow": "jetflow.pipeline",
    "Conversation": "jetflow.decoding.conversation",
    "TargetModel": "jetflow.models.target",
    "LlamaCppTarget": "jetflow.models.llamacpp_target",
    "load_target": "jetflow.models.loading",
    "DraftHead": "jetflow.models.draft_head",
    "DraftHeadConfig": "jetflow.models.draft_head",
    "load_drafter": "jetflow.models.checkpoint",
    "resolve_model": "jetflow.models.resolve",
    "SamplingParams": "jetflow.decoding.sampling",
    "GenerationResult": "jetflow.decoding.result",
    "generate": "jetflow.decoding.api",
    "stream": "jetflow.decoding.api",
    "JetFlowError": "jetflow.errors",
    "InvalidRequestError": "jetflow.errors",
    "ModelResolutionError": "jetflow.errors",
    "RequestSupersededError": "jetflow.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name):  # import torch/transformers only when an API object is first used
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jetflow' has no attribute {name!r}")
