"""TensorRT engines from the exported ONNX graphs, with the CriticalKVSelect plugin.

``build_tensorrt_engines`` parses the prefill graph (whose ``CriticalKVSelect`` nodes become plugin layers)
and the decode graph, gives every dynamic input an optimization profile derived from its dimension names,
and writes ``prefill.engine``, ``decode.engine`` and ``engines.json``. It needs the ``tensorrt`` Python
package and a CUDA GPU; ``tensorrt_unavailable_reason()`` says precisely what is missing otherwise.
``tensorrt`` is imported lazily, so this module imports everywhere; its profile logic
(``profile_shapes``, ``default_dim_ranges``) is plain Python and unit-tested on CPU.

ONNX parser note (plugins/README.md, "ONNX parser and the function body"): TensorRT 10.0-10.6 always
inlines a model-local function, TensorRT 10.7-10.14 prefers a registered plugin of the same name, and 10.15+
prefers the function again unless the node has a ``plugin_namespace`` attribute or the parser flag
``ENABLE_PLUGIN_OVERRIDE`` is set. The build therefore sets that flag when it exists, and checks that every
``CriticalKVSelect`` node became a plugin layer; the function-free TensorRT flavour of the export works
with every TensorRT 10 release.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from criticalkv.tensorrt.plugin import PLUGIN_LIBRARY_NAME, PLUGIN_NAME, load_plugin_library

DTYPES = ("float32", "float16", "bfloat16")


class TensorRTUnavailable(RuntimeError):
    """TensorRT engines cannot be built here; the message says why."""


@dataclass(frozen=True)
class DimRange:
    """min / opt / max of one dynamic dimension of an optimization profile."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.opt <= self.max:
            raise ValueError(f"DimRange: expected 0 <= min <= opt <= max, got {self.min}, {self.opt}, {self.max}")


def default_dim_ranges(
    max_batch: int,
    max_input_len: int,
    max_capacity: int,
    *,
    decode: bool = False,
    opt_batch: int | None = None,
    opt_input_len: int | None = None,
) -> dict[str, DimRange]:
    """Ranges of the symbolic dimensions of the prefill (``decode=False``) or decode graph.

    Keys are the dimension roles ``batch``, ``sequence`` (new tokens of this call: the prompt in prefill,
    1 in decode), ``past`` (compressed cache entries per head, up to ``max_capacity``) and ``total``
    (past + sequence, e.g. the decode attention mask).
    """
    for name, value in (("max_batch", max_batch), ("max_input_len", max_input_len), ("max_capacity", max_capacity)):
        if value < 1:
            raise ValueError(f"{name}: must be positive, got {value}")
    opt_b = min(opt_batch or max_batch, max_batch)
    opt_n = min(opt_input_len or max(1, max_input_len // 2), max_input_len)
    opt_past = max(1, max_capacity // 2)
    if decode:
        return {
            "batch": DimRange(1, opt_b, max_batch),
            "sequence": DimRange(1, 1, 1),
            "past": DimRange(1, opt_past, max_capacity),
            "total": DimRange(2, opt_past + 1, max_capacity + 1),
        }
    return {
        "batch": DimRange(1, opt_b, max_batch),
        "sequence": DimRange(1, opt_n, max_input_len),
        "past": DimRange(0, 0, 0),
        "total": DimRange(1, opt_n, max_input_len),
    }


#: Dimension-name patterns (onnxruntime-genai / transformers export conventions) -> role in default_dim_ranges.
DIM_ROLE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"batch", "batch"),
    (r"total|all_seq|attention_len|mask_len", "total"),
    (r"past|cache|capacity|kept|present", "past"),
    (r"seq|len|token|prompt|^n$", "sequence"),
)


def dim_role(dim_name: str) -> str:
    """Role of a symbolic dimension name: batch, sequence, past or total."""
    lowered = dim_name.lower()
    for pattern, role in DIM_ROLE_PATTERNS:
        if re.search(pattern, lowered):
            return role
    raise ValueError(
        f"dimension {dim_name!r}: cannot tell whether it is a batch, sequence, past or total length; "
        "pass dim_ranges={name: DimRange(...)} for it"
    )


def profile_shapes(
    inputs: Sequence[tuple[str, Sequence[int | str | None]]], ranges: Mapping[str, DimRange]
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(min, opt, max) shapes of every input for one optimization profile.

    Parameters
    ----------
    inputs : (input name, dims) pairs; a dim is an int (static), a str (symbolic dimension name) or None / -1
        (dynamic without a name: an error, the profile cannot be guessed)
    ranges : DimRange by exact dimension name, or by role (``batch``, ``sequence``, ``past``, ``total``)

    Returns
    -------
    {input name: (min shape, opt shape, max shape)} for the inputs with at least one dynamic dimension.
    """
    shapes = {}
    for name, dims in inputs:
        lo, opt, hi = [], [], []
        dynamic = False
        for axis, dim in enumerate(dims):
            if isinstance(dim, int) and dim >= 0:
                lo.append(dim), opt.append(dim), hi.append(dim)
                continue
            if not isinstance(dim, str) or not dim:
                raise ValueError(f"input {name!r}: axis {axis} is dynamic but unnamed; name it in the ONNX graph")
            dynamic = True
            r = ranges[dim] if dim in ranges else ranges[dim_role(dim)]
            lo.append(r.min), opt.append(r.opt), hi.append(r.max)
        if dynamic:
            shapes[name] = (tuple(lo), tuple(opt), tuple(hi))
    return shapes


def tensorrt_unavailable_reason() -> str | None:
    """None when TensorRT engines can be built here, else a sentence saying exactly what is missing."""
    try:
        import tensorrt as trt  # noqa: F401
    except Exception as error:  # ImportError, or OSError from missing libnvinfer
        return (
            f"the tensorrt Python package does not import ({type(error).__name__}: {error}); "
            "install TensorRT 10 (its libraries, not only the bindings) on a machine with an NVIDIA GPU"
        )
    try:
        import torch

        if not torch.cuda.is_available():
            return "tensorrt imports, but no CUDA GPU is visible (torch.cuda.is_available() is False)"
    except ImportError:
        pass
    return None


@dataclass
class EngineBuildResult:
    """What build_tensorrt_engines wrote."""

    prefill_engine: Path
    decode_engine: Path
    plugin_library: Path
    tensorrt_version: str
    dtype: str
    plugin_layers: int
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)


def _network_inputs(network: Any) -> list[tuple[str, list[int | str | None]]]:
    inputs = []
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        dims: list[int | str | None] = []
        for axis, d in enumerate(tensor.shape):
            if d >= 0:
                dims.append(int(d))
            else:
                get_name = getattr(tensor, "get_dimension_name", None)
                dims.append(get_name(axis) if get_name else None)
        inputs.append((tensor.name, dims))
    return inputs


def count_plugin_layers(network: Any, trt: Any) -> int:
    """Number of IPluginV3 layers of the network that are CriticalKVSelect (any V3 plugin if it cannot tell)."""
    count = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type != trt.LayerType.PLUGIN_V3:
            continue
        name = None
        try:  # downcast as TensorRT's Python samples do, then ask the plugin's core capability for its name
            layer.__class__ = trt.IPluginV3Layer
            core = layer.get_plugin().get_capability_interface(trt.PluginCapabilityType.CORE)
            name = getattr(core, "plugin_name", None)
        except Exception:  # bindings without these accessors: count every V3 plugin layer
            name = None
        if name in (None, PLUGIN_NAME):
            count += 1
    return count


def build_engine(
    trt: Any,
    logger: Any,
    onnx_path: Path,
    ranges: Mapping[str, DimRange],
    dtype: str,
    expect_plugin: bool,
    workspace_bytes: int | None = None,
    strongly_typed: bool = True,
) -> tuple[bytes, dict[str, Any], int]:
    """Serialized engine of one ONNX graph, its profile and the number of CriticalKVSelect plugin layers."""
    flags = 0
    if strongly_typed and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    builder = trt.Builder(logger)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if hasattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE"):  # TensorRT >= 10.15: prefer the plugin over the body
        parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    plugin_layers = count_plugin_layers(network, trt)
    if expect_plugin and plugin_layers == 0:
        raise RuntimeError(
            f"{onnx_path}: no {PLUGIN_NAME} plugin layer after parsing; the parser inlined the node's function body. "
            "Build from the function-free TensorRT flavour of the export (see plugins/README.md)"
        )
    config = builder.create_builder_config()
    if dtype == "float32" and hasattr(trt.BuilderFlag, "TF32"):
        # TensorRT enables TF32 by default (10-bit mantissa matmuls): an fp32 engine compared token for token
        # with ONNX Runtime must run true fp32
        config.clear_flag(trt.BuilderFlag.TF32)
    if not strongly_typed:
        if dtype == "float16":
            config.set_flag(trt.BuilderFlag.FP16)
        elif dtype == "bfloat16":
            config.set_flag(trt.BuilderFlag.BF16)
    if workspace_bytes:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    profile = builder.create_optimization_profile()
    shapes = profile_shapes(_network_inputs(network), ranges)
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path} (see the TensorRT log)")
    return bytes(serialized), {name: [list(s) for s in shape] for name, shape in shapes.items()}, plugin_layers


def build_tensorrt_engines(
    onnx_prefill_path: str | Path,
    onnx_decode_path: str | Path,
    output_dir: str | Path,
    plugin_library: str | Path | None = None,
    max_batch: int = 1,
    max_input_len: int = 4096,
    max_capacity: int = 4096,
    dtype: str = "float16",
    *,
    opt_batch: int | None = None,
    opt_input_len: int | None = None,
    dim_ranges: Mapping[str, DimRange] | None = None,
    workspace_bytes: int | None = None,
    strongly_typed: bool = True,
    log_level: str = "WARNING",
) -> EngineBuildResult:
    """Build the prefill and decode TensorRT engines.

    Parameters
    ----------
    onnx_prefill_path : the prefill graph (CriticalKVSelect nodes; preferably the function-free TensorRT flavour)
    onnx_decode_path : the decode graph
    output_dir : where prefill.engine, decode.engine and engines.json are written
    plugin_library : libcriticalkv_trt_plugin.so (default: find_plugin_library()); copied into ``output_dir``
        so that the engines and the plugin they were built with travel together
    max_batch, max_input_len, max_capacity : the largest batch, prompt length and compressed cache length
        (per KV head; the prefill graph's node_capacity) the engines accept
    dtype : float32, float16 or bfloat16 (the export's dtype when strongly_typed, else a builder precision
        flag); float32 builds clear TF32 (TensorRT's default) so that they compute in fp32
    dim_ranges : DimRange overrides by dimension name or role, applied to both graphs

    Raises
    ------
    TensorRTUnavailable
        When tensorrt does not import or no GPU is visible (see tensorrt_unavailable_reason()).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    reason = tensorrt_unavailable_reason()
    if reason is not None:
        raise TensorRTUnavailable(reason)
    import tensorrt as trt

    logger = trt.Logger(getattr(trt.Logger, log_level))
    library = load_plugin_library(plugin_library, trt.get_plugin_registry())
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    bundled = output_dir / PLUGIN_LIBRARY_NAME
    if library.resolve() != bundled.resolve():
        shutil.copy2(library, bundled)
    result = EngineBuildResult(
        prefill_engine=output_dir / "prefill.engine",
        decode_engine=output_dir / "decode.engine",
        plugin_library=bundled,
        tensorrt_version=trt.__version__,
        dtype=dtype,
        plugin_layers=0,
    )
    for role, onnx_path, target in (
        ("prefill", Path(onnx_prefill_path), result.prefill_engine),
        ("decode", Path(onnx_decode_path), result.decode_engine),
    ):
        ranges = {
            **default_dim_ranges(max_batch, max_input_len, max_capacity, decode=role == "decode",
                                 opt_batch=opt_batch, opt_input_len=opt_input_len),
            **(dim_ranges or {}),
        }
        blob, profile, plugin_layers = build_engine(
            trt, logger, onnx_path, ranges, dtype, expect_plugin=role == "prefill",
            workspace_bytes=workspace_bytes, strongly_typed=strongly_typed,
        )
        target.write_bytes(blob)
        result.profiles[role] = profile
        if role == "prefill":
            result.plugin_layers = plugin_layers
    # paths relative to output_dir: the folder can move
    manifest = {k: v.name if isinstance(v, Path) else v for k, v in asdict(result).items()}
    (output_dir / "engines.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return result
