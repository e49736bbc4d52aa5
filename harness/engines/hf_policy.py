"""The rollout engine's stand-in on CPU: a Hugging Face model built from the model's config, loaded from an exported
stream, and the next-token log-probs it computes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# What building the Hugging Face models of the shipped models imports (about 2 s on a 2-core VM): a suite that builds
# one in a rank lists them among its imports, so its fork server imports them once, not each rank.
HF_MODEL_MODULES = ("transformers", "transformers.models.llama.modeling_llama",
                    "transformers.models.qwen3_moe.modeling_qwen3_moe")

if TYPE_CHECKING:
    import torch

    from harness.spec import ModelSpec


def label_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[batch, seq] log-prob of each next token, in float64."""
    import torch

    lp = torch.log_softmax(logits.double(), dim=-1)
    return lp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def policy_logprobs(model: ModelSpec, dtype_name: str, stream: dict[str, Any], tokens: torch.Tensor,
                    built: dict[str, Any] | None = None) -> tuple[torch.Tensor | None, str]:
    """The tokens' ([batch, seq + 1]) next-token log-probs through the Hugging Face model loaded from `stream`
    (HF names; a tied key may be absent); (None, why) where no Hugging Face class holds the model here or the stream
    does not load strictly. built: where the model built on a first call is kept for the next ones (each loads every
    key again, strictly)."""
    import torch
    from transformers import AutoModelForCausalLM

    from harness.dtypes import dtype
    from harness.engines.hf_weights import to_module_format
    from harness.engines.mbridge import hf_architecture, hf_config
    from harness.errors import BadInput

    try:
        hf_architecture(model)
    except BadInput as exc:
        return None, str(exc)
    config = hf_config(model)
    hf = (built or {}).get("model") or AutoModelForCausalLM.from_config(config, torch_dtype=dtype(dtype_name).torch)
    hf.eval()
    if built is not None:
        built["model"] = hf
    try:
        res = hf.load_state_dict(to_module_format(stream, set(hf.state_dict())), strict=False)
    except RuntimeError as exc:  # shapes HF refuses
        return None, f"the stream does not load into the Hugging Face model: {str(exc).splitlines()[0][:200]}"
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = [k for k in res.missing_keys if k not in tied]
    if missing or res.unexpected_keys:
        return None, (f"the stream does not load into the Hugging Face model strictly: missing {missing[:3]}, "
                      f"unexpected {list(res.unexpected_keys)[:3]}")
    with torch.no_grad():
        return label_logprobs(hf(input_ids=tokens[:, :-1]).logits, tokens), ""
