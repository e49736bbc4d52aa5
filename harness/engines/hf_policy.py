"""The rollout engine's stand-in on CPU: a Hugging Face model built from the model's config, loaded from an exported
stream, and the next-token log-probs it computes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.dtypes import dtype
from harness.engines.hf_weights import to_module_format
from harness.engines.mbridge import hf_architecture, hf_config
from harness.errors import BadInput

if TYPE_CHECKING:
    import torch

    from harness.spec import ModelSpec


# What building the Hugging Face models of the shipped models imports (about 2 s on a 2-core VM): a suite that builds
# one in a rank lists them among its imports (hf_model_modules), so its fork server imports them once, not each rank.
HF_MODEL_MODULES = ("transformers", "transformers.models.llama.modeling_llama",
                    "transformers.models.qwen3_moe.modeling_qwen3_moe")


def hf_model_modules() -> tuple[str, ...]:
    """HF_MODEL_MODULES as the installed transformers has them: none without transformers (the suite's Hugging Face
    side then says it cannot tell), Qwen3-MoE's from transformers 4.51. Read from the package's metadata: nothing is
    imported."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("transformers")
    except PackageNotFoundError:
        return ()
    try:
        major, minor = (int(x) for x in release.split(".")[:2])
    except ValueError:
        return HF_MODEL_MODULES[:1]
    return HF_MODEL_MODULES if (major, minor) >= (4, 51) else HF_MODEL_MODULES[:2]


def label_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[batch, seq] log-prob of each next token at the sampling temperature, in float64."""
    return _at_labels(_log_softmax(logits, temperature), tokens)


def _log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[batch, seq, vocab] log-probs at the sampling temperature, in float64."""
    import torch

    z = logits.double()
    return torch.log_softmax(z if temperature == 1.0 else z / temperature, dim=-1)


def _at_labels(lp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return lp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


class StreamDoesNotLoad(Exception):
    """The exported stream does not load into the Hugging Face model strictly: the rollout could not use it."""


def loaded_model(model: ModelSpec, dtype_name: str, stream: dict[str, Any], built: dict[str, Any] | None = None
                 ) -> tuple[Any, str]:
    """The Hugging Face model of `model` with `stream` (HF names; a tied key may be absent) loaded strictly, in eval
    mode; (None, why) where no Hugging Face class holds the model here or transformers is not installed. Raises
    StreamDoesNotLoad where the stream does not load strictly. built: where the model built on a first call is kept
    for the next ones (each loads every key again, strictly)."""

    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        return None, f"transformers is not installed here ({exc}): pip install -e .[bridge]"
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
        raise StreamDoesNotLoad(str(exc).splitlines()[0][:200]) from None
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = [k for k in res.missing_keys if k not in tied]
    if missing or res.unexpected_keys:
        raise StreamDoesNotLoad(f"missing {missing[:3]}, unexpected {list(res.unexpected_keys)[:3]}")
    return hf, ""


def policy_logprobs(model: ModelSpec, dtype_name: str, stream: dict[str, Any], tokens: torch.Tensor,
                    built: dict[str, Any] | None = None, temperature: float = 1.0
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, str]:
    """The tokens' ([batch, seq + 1]) next-token log-probs and entropies at the sampling temperature through the
    Hugging Face model loaded from `stream` (`loaded_model`, which says when there is none and raises where the stream
    does not load)."""
    import torch

    hf, why = loaded_model(model, dtype_name, stream, built)
    if hf is None:
        return None, None, why
    with torch.no_grad():
        lp = _log_softmax(hf(input_ids=tokens[:, :-1]).logits, temperature)
        return _at_labels(lp, tokens), -(lp.exp() * lp).sum(dim=-1), ""


def adapter_policy_logprobs(model: ModelSpec, dtype_name: str, base: dict[str, Any], adapter_dir: str,
                            tokens: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor | None, str]:
    """The tokens' next-token log-probs through a Hugging Face model holding the base weights (HF names) with the
    HF PEFT adapter directory loaded by peft, as a rollout engine serves an adapter-only refit; (None, why) where
    peft is not installed or no Hugging Face class holds the model. Raises StreamDoesNotLoad where the base or the
    adapter does not load."""
    import warnings

    try:
        import peft
    except ImportError as exc:
        return None, f"peft is not installed here ({exc}): pip install peft"
    hf, why = loaded_model(model, dtype_name, base)  # a fresh model: peft wraps the one it is given
    if hf is None:
        return None, why
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            served = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    except Exception as exc:  # an adapter peft refuses is the finding
        raise StreamDoesNotLoad(f"peft: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                                ) from None
    import torch

    with torch.no_grad():
        return label_logprobs(served(input_ids=tokens[:, :-1]).logits, tokens, temperature), ""

