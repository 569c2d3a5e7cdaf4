"""TensorRT engines from the exported ONNX graphs, with the CriticalKVSelect plugin.

``build_tensorrt_engines`` parses the prefill graph (whose ``CriticalKVSelect`` nodes become plugin layers),
the decode graph and, when given, the extend and select graphs of chunked prefill and the context cache
(``extend_tensorrt.onnx``, ``select_tensorrt.onnx``), gives every dynamic input an optimization profile derived
from its dimension names, and writes ``prefill.engine``, ``decode.engine`` (``extend.engine``, ``select.engine``)
and ``engines.json``. It needs the ``tensorrt`` Python package and a CUDA GPU; ``tensorrt_unavailable_reason()``
says precisely what is missing otherwise. ``tensorrt`` is imported lazily, so this module imports everywhere; its
profile logic (``engine_plan``, ``profile_shapes``, the ``*_dim_ranges``) is plain Python and unit-tested on CPU.

ONNX parser note (docs/kernels.md, "ONNX parser and the function body"): TensorRT 10.0-10.6 always
inlines a model-local function, TensorRT 10.7-10.14 prefers a registered plugin of the same name, and 10.15+
prefers the function again unless the node has a ``plugin_namespace`` attribute or the parser flag
``ENABLE_PLUGIN_OVERRIDE`` is set. The build therefore sets that flag when it exists, and checks that every
``CriticalKVSelect`` node became a plugin layer; the function-free TensorRT flavour of the export works
with every TensorRT 10 release.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from criticalkv.tensorrt.plugin import PLUGIN_LIBRARY_NAME, PLUGIN_NAME, PLUGIN_NAMES, load_plugin_library

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


def _positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")


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
    _positive(max_batch=max_batch, max_input_len=max_input_len, max_capacity=max_capacity)
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


#: The batch of the extend and select engines: the runtime runs them one sequence at a time (``Engine.extend``,
#: ``prefill_step``, ``finish_prefill``), and their attention scores and selection workspace grow with it.
SINGLE_SEQUENCE = DimRange(1, 1, 1)


def extend_dim_ranges(extend_chunk: int, capacities: Sequence[int], window: int, *,
                      opt_capacity: int | None = None) -> dict[str, DimRange]:
    """Ranges of the dimensions of ``extend_tensorrt.onnx``.

    ``batch`` 1 (``SINGLE_SEQUENCE``); ``sequence`` (``new_tokens``) 1..extend_chunk, tuned at extend_chunk (the
    chunks of a chunked prefill); ``capacity_{l}`` 1..capacities[l] (the buffers extended: a slot's decode buffers or
    a prompt's prefill buffer, which holds exactly the prompt; pass the larger of layer l's decode capacity and
    max_input_len), tuned at ``opt_capacity`` (default half the largest); ``window`` (``window_tokens``, an output's
    dimension) 1..window.
    """
    _positive(extend_chunk=extend_chunk, window=window)
    if not capacities:
        raise ValueError("capacities: one per layer, got none")
    _positive(**{f"capacities[{i}]": c for i, c in enumerate(capacities)})
    opt = opt_capacity if opt_capacity is not None else max(1, max(capacities) // 2)
    _positive(opt_capacity=opt)
    return {
        "batch": SINGLE_SEQUENCE,
        "sequence": DimRange(1, extend_chunk, extend_chunk),
        "window": DimRange(1, window, window),
        **{f"capacity_{i}": DimRange(1, min(opt, c), c) for i, c in enumerate(capacities)},
    }


def select_dim_ranges(max_input_len: int, window: int, *, opt_input_len: int | None = None) -> dict[str, DimRange]:
    """Ranges of the dimensions of ``select_tensorrt.onnx``: ``batch`` 1 (``SINGLE_SEQUENCE``); ``sequence``
    (``prompt_tokens``: the prompt's K/V, exactly its n entries per head) 1..max_input_len, tuned at
    ``opt_input_len`` (default half); ``window`` (``window_tokens``: the last min(window, n) queries) 1..window.
    The selection's workspace is sized from the max shapes (the plugin's getWorkspaceSize)."""
    _positive(max_input_len=max_input_len, window=window)
    opt_n = min(opt_input_len or max(1, max_input_len // 2), max_input_len)
    return {"batch": SINGLE_SEQUENCE, "sequence": DimRange(1, opt_n, max_input_len), "window": DimRange(1, window, window)}


#: Dimension-name patterns (onnxruntime-genai / transformers export conventions) -> role in the *_dim_ranges.
#: ``window`` comes before ``sequence``: ``window_tokens`` (the last min(window, n) queries) is no sequence length.
DIM_ROLE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"batch", "batch"),
    (r"window", "window"),
    (r"total|all_seq|attention_len|mask_len", "total"),
    (r"past|cache|capacity|kept|present", "past"),
    (r"seq|len|token|prompt|^n$", "sequence"),
)


def dim_role(dim_name: str) -> str:
    """Role of a symbolic dimension name: batch, window, sequence, past or total."""
    lowered = dim_name.lower()
    for pattern, role in DIM_ROLE_PATTERNS:
        if re.search(pattern, lowered):
            return role
    raise ValueError(
        f"dimension {dim_name!r}: cannot tell whether it is a batch, window, sequence, past or total length; "
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
            role = dim if dim in ranges else dim_role(dim)
            if role not in ranges:
                raise ValueError(f"input {name!r}: axis {axis} ({dim!r}, a {role} dimension) has no range; "
                                 f"give one for {dim!r} or for the role {role!r}")
            r = ranges[role]
            lo.append(r.min), opt.append(r.opt), hi.append(r.max)
        if dynamic:
            shapes[name] = (tuple(lo), tuple(opt), tuple(hi))
    return shapes


def tensorrt_installed() -> bool:
    """Whether a ``tensorrt`` Python package is installed (it may still fail to import: its libraries, no GPU)."""
    import importlib.util

    return importlib.util.find_spec("tensorrt") is not None


def tensorrt_unavailable_reason() -> str | None:
    """None when TensorRT engines can be built here, else a sentence saying exactly what is missing."""
    if not tensorrt_installed():
        return "TensorRT is not installed here (no tensorrt Python package)"
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


#: The engine file of each graph, in the engine build's output folder.
ENGINE_FILES = {"prefill": "prefill.engine", "decode": "decode.engine", "extend": "extend.engine",
                "select": "select.engine"}


@dataclass
class EngineBuildResult:
    """What build_tensorrt_engines wrote. ``extend_engine`` / ``select_engine`` are None when the build had no
    extend and select graphs; ``plugin_layers`` / ``select_plugin_layers`` count the CriticalKVSelect layers of the
    prefill and select engines."""

    prefill_engine: Path
    decode_engine: Path
    plugin_library: Path
    tensorrt_version: str
    dtype: str
    plugin_layers: int
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    extend_engine: Path | None = None
    select_engine: Path | None = None
    select_plugin_layers: int = 0

    def engines(self) -> dict[str, Path]:
        """{graph: engine file} of the engines built."""
        found = {"prefill": self.prefill_engine, "decode": self.decode_engine, "extend": self.extend_engine,
                 "select": self.select_engine}
        return {graph: path for graph, path in found.items() if path is not None}

    def manifest_entry(self, engine_dir: Path) -> dict[str, Any]:
        """The ``tensorrt`` entry of an engine directory's manifest.json: files relative to ``engine_dir`` (the
        directory moves with them); the runtime finds the engines by ``engines``."""
        relative = lambda path: Path(os.path.relpath(path, engine_dir)).as_posix()  # noqa: E731
        return {"built": True, "tensorrt_version": self.tensorrt_version, "dtype": self.dtype,
                "plugin_layers": self.plugin_layers, "select_plugin_layers": self.select_plugin_layers,
                "plugin_library": relative(self.plugin_library),
                "engines": {graph: relative(path) for graph, path in self.engines().items()}}


@dataclass(frozen=True)
class EnginePlan:
    """One engine to build: its graph, ONNX file, engine file, optimization-profile ranges, and whether its
    CriticalKVSelect nodes must become plugin layers."""

    graph: str
    onnx_path: Path
    engine_path: Path
    ranges: Mapping[str, DimRange]
    expect_plugin: bool


def engine_plan(
    onnx_prefill_path: str | Path,
    onnx_decode_path: str | Path,
    output_dir: str | Path,
    max_batch: int,
    max_input_len: int,
    max_capacity: int,
    *,
    onnx_extend_path: str | Path | None = None,
    onnx_select_path: str | Path | None = None,
    extend_chunk: int | None = None,
    extend_capacities: Sequence[int] | None = None,
    window: int | None = None,
    opt_batch: int | None = None,
    opt_input_len: int | None = None,
    dim_ranges: Mapping[str, DimRange] | None = None,
) -> list[EnginePlan]:
    """The engines ``build_tensorrt_engines`` builds, in order (arguments as there); plain Python."""
    if (onnx_extend_path is None) != (onnx_select_path is None):
        raise ValueError("the extend and select graphs go together (chunked prefill needs both): give both or neither")
    output_dir = Path(output_dir)
    overrides = dict(dim_ranges or {})
    plan = [
        EnginePlan(graph, Path(path), output_dir / ENGINE_FILES[graph],
                   {**default_dim_ranges(max_batch, max_input_len, max_capacity, decode=graph == "decode",
                                         opt_batch=opt_batch, opt_input_len=opt_input_len), **overrides},
                   expect_plugin=graph == "prefill")
        for graph, path in (("prefill", onnx_prefill_path), ("decode", onnx_decode_path))
    ]
    if onnx_extend_path is not None:
        if extend_chunk is None or extend_capacities is None or window is None:
            raise ValueError("extend and select engines need extend_chunk, extend_capacities (one per layer) and window")
        plan.append(EnginePlan("extend", Path(onnx_extend_path), output_dir / ENGINE_FILES["extend"],
                               {**extend_dim_ranges(extend_chunk, extend_capacities, window,
                                                    opt_capacity=opt_input_len), **overrides},
                               expect_plugin=False))
        plan.append(EnginePlan("select", Path(onnx_select_path), output_dir / ENGINE_FILES["select"],
                               {**select_dim_ranges(max_input_len, window, opt_input_len=opt_input_len), **overrides},
                               expect_plugin=True))
    return plan


def onnx_graph_inputs(onnx_path: str | Path) -> list[tuple[str, list[int | str | None]]]:
    """(name, dims) of an ONNX file's graph inputs as the TensorRT parser declares them: a static dim as its int, a
    symbolic one by its name (the parser passes ``dim_param`` to ``ITensor::setDimensionName``), None if unnamed."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}
    inputs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in value.type.tensor_type.shape.dim]
        inputs.append((value.name, dims))
    return inputs


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
    """Number of IPluginV3 layers of the network that are criticalkv's (CriticalKVSelect, or the model-level selection's
    CriticalKVScore / CriticalKVSelectModel; any V3 plugin if it cannot tell)."""
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
        if name is None or name in PLUGIN_NAMES:
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
    onnx_extend_path: str | Path | None = None,
    onnx_select_path: str | Path | None = None,
    extend_chunk: int | None = None,
    extend_capacities: Sequence[int] | None = None,
    window: int | None = None,
    opt_batch: int | None = None,
    opt_input_len: int | None = None,
    dim_ranges: Mapping[str, DimRange] | None = None,
    workspace_bytes: int | None = None,
    strongly_typed: bool = True,
    log_level: str = "WARNING",
) -> EngineBuildResult:
    """Build the prefill and decode TensorRT engines, and the extend and select engines when their graphs are given.

    Parameters
    ----------
    onnx_prefill_path : the prefill graph (CriticalKVSelect nodes; preferably the function-free TensorRT flavour)
    onnx_decode_path : the decode graph
    output_dir : where prefill.engine, decode.engine (extend.engine, select.engine) and engines.json are written
    plugin_library : libcriticalkv_trt_plugin.so (default: find_plugin_library()); copied into ``output_dir``
        so that the engines and the plugin they were built with travel together
    max_batch, max_input_len, max_capacity : the largest batch, prompt length and compressed cache length
        (per KV head; the prefill graph's node_capacity) the engines accept
    dtype : float32, float16 or bfloat16 (the export's dtype when strongly_typed, else a builder precision
        flag); float32 builds clear TF32 (TensorRT's default) so that they compute in fp32
    onnx_extend_path, onnx_select_path : ``extend_tensorrt.onnx`` and ``select_tensorrt.onnx`` (both or neither)
    extend_chunk : most new tokens of one extend run (the build's ``extend_chunk``)
    extend_capacities : per layer, the largest buffer an extend runs over: max(decode capacity, max_input_len)
    window : the policy's window (the select graph's window queries)
    dim_ranges : DimRange overrides by dimension name or role, applied to every graph

    Raises
    ------
    TensorRTUnavailable
        When tensorrt does not import or no GPU is visible (see tensorrt_unavailable_reason()).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    plan = engine_plan(onnx_prefill_path, onnx_decode_path, output_dir, max_batch, max_input_len, max_capacity,
                       onnx_extend_path=onnx_extend_path, onnx_select_path=onnx_select_path, extend_chunk=extend_chunk,
                       extend_capacities=extend_capacities, window=window, opt_batch=opt_batch,
                       opt_input_len=opt_input_len, dim_ranges=dim_ranges)
    reason = tensorrt_unavailable_reason()
    if reason is not None:
        raise TensorRTUnavailable(reason)
    import tensorrt as trt  # optional: only on a GPU machine with TensorRT (checked just above)

    logger = trt.Logger(getattr(trt.Logger, log_level))
    library = load_plugin_library(plugin_library, trt.get_plugin_registry())
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    bundled = output_dir / PLUGIN_LIBRARY_NAME
    if library.resolve() != bundled.resolve():
        shutil.copy2(library, bundled)
    built = {}
    result = EngineBuildResult(
        prefill_engine=output_dir / ENGINE_FILES["prefill"],
        decode_engine=output_dir / ENGINE_FILES["decode"],
        plugin_library=bundled,
        tensorrt_version=trt.__version__,
        dtype=dtype,
        plugin_layers=0,
    )
    for step in plan:
        blob, profile, plugin_layers = build_engine(
            trt, logger, step.onnx_path, step.ranges, dtype, expect_plugin=step.expect_plugin,
            workspace_bytes=workspace_bytes, strongly_typed=strongly_typed,
        )
        step.engine_path.write_bytes(blob)
        result.profiles[step.graph] = profile
        built[step.graph] = (step.engine_path, plugin_layers)
    result.plugin_layers = built["prefill"][1]
    if "extend" in built:
        result.extend_engine, result.select_engine = built["extend"][0], built["select"][0]
        result.select_plugin_layers = built["select"][1]
    # paths relative to output_dir: the folder can move
    manifest = {k: v.name if isinstance(v, Path) else v for k, v in asdict(result).items()}
    (output_dir / "engines.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return result
