"""TensorRT side of criticalkv: the CriticalKVSelect plugin library and engine building.

* ``plugin``: find / check / register ``libcriticalkv_trt_plugin.so`` (built by scripts/build_plugin.sh);
* the plugin creator's fields come from ``criticalkv.spec.generate`` (generated from ``KVPolicy``);
* ``tensorrt_build``: ``build_tensorrt_engines`` (prefill, decode, extend and select engines, optimization
  profiles: ``engine_plan``) and ``tensorrt_unavailable_reason``. ``tensorrt`` is imported only when an engine is built.
"""

from criticalkv.tensorrt.plugin import (
    PLUGIN_LIBRARY_ENV,
    PLUGIN_LIBRARY_NAME,
    PLUGIN_NAME,
    check_plugin_library,
    find_plugin_library,
    load_plugin_library,
    resolve_plugin_library,
)
from criticalkv.spec.generate import plugin_field_specs, render_policy_fields_header
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
    "render_policy_fields_header",
    "resolve_plugin_library",
    "tensorrt_unavailable_reason",
]
