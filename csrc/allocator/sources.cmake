# Allocator core and backends, compiled into april_core. GPU backends only when their headers exist.
target_sources(april_core PRIVATE
)
if(APRIL_CUDA_INCLUDE)
  target_compile_definitions(april_core PUBLIC APRIL_EXT_WITH_CUDA=1)
endif()
if(APRIL_HIP_INCLUDE)
  target_compile_definitions(april_core PUBLIC APRIL_EXT_WITH_HIP=1)
endif()
