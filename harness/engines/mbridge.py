"""The `mbridge` engine: the "vanilla bridge" construction path of regression R2.

The model is built by PyPI `mbridge` (`AutoBridge.from_config(hf_config)` then
`bridge.get_model(wrap_with_ddp=True, ddp_config=dict)`), whose get_model defaults to
use_distributed_optimizer=True; the DDP config dict comes from the wrap-config layer. The
optimizer is built from what the user configured, as the RL frameworks did - so a DDP config that
lost the user's choice shows up as the wrong collective (and drifting replicas).

CPU substitutions (CPU ranks only): the bridge asks for the Transformer Engine layer spec, which
needs CUDA, so the bridge instance's `_get_transformer_layer_spec` returns the local spec (with the
reference CP attention when CP > 1); fused kernels are switched off and dropout set to 0 on the
TransformerConfig the bridge built, as the `mcore` engine does; the bridge's sequence_parallel=True
(with TP > 1) is turned off because the local spec's torch norms do not support it.
"""

from __future__ import annotations

from typing import Any

from harness.engines.mcore import McoreEngine, layer_spec
from harness.engines.wrap_config import WrapConfig, ddp_config_dict
from harness.errors import MissingDependency

INSTALL = "pip install -c constraints-cpu.txt -e .[mbridge]"
_CPU_OFF = ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
            "persist_layer_norm", "gradient_accumulation_fusion")


def check_available() -> None:
    """MissingDependency naming the install command when mbridge / transformers cannot be imported."""
    try:
        import mbridge  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise MissingDependency(f"engine 'mbridge' needs {exc.name!r}: {INSTALL}") from None


def hf_llama_config(case):
    """A Hugging Face LlamaConfig with the case's model shape (built in code, nothing downloaded)."""
    from transformers import LlamaConfig

    m = case.model
    return LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups, max_position_embeddings=m.seq_length,
        tie_word_embeddings=m.tie_embeddings, rope_theta=10000.0, hidden_act="silu", attention_bias=False,
        attention_dropout=0.0, rms_norm_eps=1e-5,
    )


class MbridgeEngine(McoreEngine):
    overrides: dict[str, Any] | None = None  # the framework's optional DDP override dict

    def bridge_ddp_config(self) -> dict[str, Any]:
        """What this path hands to bridge.get_model(ddp_config=...): the merged wrap config."""
        return ddp_config_dict(WrapConfig.from_options(self.case.options), self.overrides)

    def build(self) -> None:
        check_available()
        from mbridge import AutoBridge

        from harness.engines.mcore import _DTYPES

        self.setup_parallel()
        bridge = AutoBridge.from_config(hf_llama_config(self.case), dtype=_DTYPES[self.case.options.dtype])
        cfg = bridge.config
        cfg.hidden_dropout = cfg.attention_dropout = 0.0
        cfg.use_cpu_initialization = True
        if self.ctx.on_cpu:
            for name in _CPU_OFF:
                if hasattr(cfg, name):
                    setattr(cfg, name, False)
            # The bridge turns sequence parallel on with TP > 1; the local spec's torch norms refuse it.
            cfg.sequence_parallel = False
            spec = layer_spec(True, self.case.model.normalization, self.case.layout.cp)
            bridge._get_transformer_layer_spec = lambda vp_stage=None: spec
        o = self.case.options
        self.models = bridge.get_model(
            wrap_with_ddp=True, ddp_config=self.bridge_ddp_config(), bf16=o.dtype == "bf16",
            fp16=o.dtype == "fp16", use_cpu_initialization=True,
        )
        self.config = cfg
        for model in self.models:
            self.reinit(model.module)
        self.optimizer = self.make_optimizer(self.models, o.use_distributed_optimizer)
        self._wire_config()
