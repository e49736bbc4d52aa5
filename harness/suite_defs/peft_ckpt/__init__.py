"""`peft-ckpt` (regression R4): LoRA adapters exported in Hugging Face PEFT format load in PEFT and reproduce the
Megatron model at every layout. The package: suite.py (the Suite the registry names: cases and rank work),
judge.py (the checks, in the parent)."""

from harness.suite_defs.peft_ckpt.suite import PeftCkptSuite

__all__ = ["PeftCkptSuite"]
