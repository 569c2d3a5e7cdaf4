"""TensorRT side of criticalkv: the CriticalKVSelect plugin library and engine building.

* ``plugin``: find / check / register ``libcriticalkv_trt_plugin.so`` (built by scripts/build_plugin.sh);
* the plugin creator's fields are the ``CriticalKVSelect`` node's attributes (``criticalkv.node.plugin_field_specs``,
  from ``KVPolicy``); ``criticalkv.spec.generate`` writes the C++ header of them;
* ``tensorrt_build``: ``build_tensorrt_engines`` (prefill, decode, extend and select engines, optimization
  profiles: ``engine_plan``) and ``tensorrt_unavailable_reason``. ``tensorrt`` is imported only when an engine is built.
"""

from criticalkv.node import plugin_field_specs
from criticalkv.tensorrt.plugin import (
    PLUGIN_LIBRARY_ENV,
    PLUGIN_LIBRARY_NAME,
    PLUGIN_NAME,
    check_plugin_library,
    find_plugin_library,
    load_plugin_library,
    resolve_plugin_library,
)
from criticalkv.tensorrt.tensorrt_build import (
    ENGINE_FILES,
    DimRange,
    EngineBuildResult,
    EnginePlan,
    TensorRTUnavailable,
    build_tensorrt_engines,
    default_dim_ranges,
    dim_role,
    engine_plan,
    extend_dim_ranges,
    onnx_graph_inputs,
    profile_shapes,
    select_dim_ranges,
    tensorrt_installed,
    tensorrt_unavailable_reason,
)

__all__ = [
    "ENGINE_FILES",
    "EnginePlan",
    "engine_plan",
    "extend_dim_ranges",
    "onnx_graph_inputs",
    "select_dim_ranges",
    "PLUGIN_LIBRARY_ENV",
    "PLUGIN_LIBRARY_NAME",
    "PLUGIN_NAME",
    "DimRange",
    "EngineBuildResult",
    "TensorRTUnavailable",
    "build_tensorrt_engines",
    "check_plugin_library",
    "default_dim_ranges",
    "dim_role",
    "find_plugin_library",
    "load_plugin_library",
    "plugin_field_specs",
    "profile_shapes",
    "resolve_plugin_library",
    "tensorrt_installed",
    "tensorrt_unavailable_reason",
]
