"""The `megatron-bridge` engine: the model-provider construction path (R2's correct route).

`AutoBridge.from_hf_config(LlamaConfig)` -> `to_megatron_provider(load_weights=False)` -> the
provider's parallel sizes and CPU settings -> `finalize()` ->
`provide_distributed_model(ddp_config=DistributedDataParallelConfig(**wrap config), wrap_with_ddp=True)`.

`import megatron.bridge` needs transformer_engine (and, through its model zoo, triton, mamba_ssm,
...) even for a plain GPT; on ranks without them the import runs behind a *scoped* stub
(`_stubbed_imports`): megatron.core is imported first so its HAVE_TE flags stay False, the stub
finder is removed right after the import, and the local layer spec is set on the provider.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys
import types

from harness.engines.mbridge import hf_llama_config
from harness.engines.mcore import _DTYPES, McoreEngine, layer_spec
from harness.engines.wrap_config import WrapConfig, ddp_config_dict
from harness.errors import MissingDependency

INSTALL = "pip install --no-deps megatron-bridge==0.3.1 && pip install -c constraints-cpu.txt -e .[bridge]"
_STUBBED = ("transformer_engine", "triton", "mamba_ssm", "causal_conv1d", "flash_attn", "fla",
            "nvidia_resiliency_ext", "wandb")


class _Stub(types.ModuleType):
    """A module whose every attribute exists: submodules, classes to subclass, no-op callables."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            value = type(name, (), {"__init__": lambda self, *a, **k: None})
        else:
            value = _Stub(f"{self.__name__}.{name}")
            value.__path__ = []
            sys.modules[value.__name__] = value
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else None


def _importer() -> str:
    """Name of the module whose import statement is being executed."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class _StubFinder:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top not in _STUBBED:
            return None
        # megatron.core keeps seeing no Transformer Engine (its HAVE_TE flags stay False); only the
        # bridge's own modules get the TE stub. The other stubbed packages are optional kernels.
        if top == "transformer_engine" and not _importer().startswith("megatron.bridge"):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


# megatron.core modules whose HAVE_TE flags must be settled (False) before any stub exists.
_SETTLE_FIRST = ("megatron.core", "megatron.core.transformer.attention", "megatron.core.transformer.transformer_layer",
                 "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.distributed",
                 "megatron.core.optimizer", "megatron.core.pipeline_parallel", "megatron.core.tensor_parallel")


@contextlib.contextmanager
def _stubbed_imports():
    for module in _SETTLE_FIRST:
        importlib.import_module(module)
    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        # Later imports must not find the TE stub in the module cache (the bridge keeps its references).
        for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
            del sys.modules[name]


def import_bridge():
    try:
        import megatron.bridge  # noqa: F401
        from megatron.bridge import AutoBridge
        return AutoBridge
    except ImportError:
        pass
    for name in [m for m in sys.modules if m.startswith("megatron.bridge")]:
        del sys.modules[name]
    with _stubbed_imports():
        from megatron.bridge import AutoBridge
    return AutoBridge


def check_available() -> None:
    if importlib.util.find_spec("megatron.bridge") is None or importlib.util.find_spec("transformers") is None:
        raise MissingDependency(f"engine 'megatron-bridge' needs megatron-bridge and transformers: {INSTALL}")


class MegatronBridgeEngine(McoreEngine):
    overrides: dict | None = None

    def build(self) -> None:
        check_available()
        from megatron.core.distributed import DistributedDataParallelConfig

        AutoBridge = import_bridge()
        self.setup_parallel()
        lay, o = self.case.layout, self.case.options
        hf = hf_llama_config(self.case)
        hf.architectures = ["LlamaForCausalLM"]
        provider = AutoBridge.from_hf_config(hf).to_megatron_provider(load_weights=False)
        provider.tensor_model_parallel_size = lay.tp
        provider.pipeline_model_parallel_size = lay.pp
        provider.virtual_pipeline_model_parallel_size = lay.vpp if lay.vpp > 1 else None
        provider.context_parallel_size = lay.cp
        provider.sequence_parallel = False
        dtype = _DTYPES[o.dtype]
        provider.params_dtype = provider.pipeline_dtype = dtype
        provider.bf16, provider.fp16 = o.dtype == "bf16", o.dtype == "fp16"
        provider.hidden_dropout = provider.attention_dropout = 0.0
        provider.use_cpu_initialization = True
        if self.ctx.on_cpu:
            for name in ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                         "apply_rope_fusion", "persist_layer_norm", "gradient_accumulation_fusion"):
                if hasattr(provider, name):
                    setattr(provider, name, False)
            provider.transformer_layer_spec = layer_spec(True, self.case.model.normalization, lay.cp)
        provider.batch_p2p_comm = not lay.vpp > 1
        provider.finalize()
        ddp = DistributedDataParallelConfig(**ddp_config_dict(WrapConfig.from_options(o), self.overrides))
        self.models = provider.provide_distributed_model(ddp_config=ddp, wrap_with_ddp=True,
                                                         use_cpu_initialization=True, fp16=provider.fp16,
                                                         bf16=provider.bf16)
        self.config = self.models[0].config if hasattr(self.models[0], "config") else provider
        for model in self.models:
            self.reinit(model.module)
        self.optimizer = self.make_optimizer(self.models, o.use_distributed_optimizer)
        self._wire_config()
