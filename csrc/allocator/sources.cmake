# Allocator core and backends, compiled into april_core. GPU backends only when their headers exist.
target_sources(april_core PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/allocator.cpp
  ${CMAKE_CURRENT_LIST_DIR}/backup_cache.cpp
  ${CMAKE_CURRENT_LIST_DIR}/cpu_backend.cpp
  ${CMAKE_CURRENT_LIST_DIR}/dlpack_export.cpp
  ${CMAKE_CURRENT_LIST_DIR}/dynamic_library.cpp
  ${CMAKE_CURRENT_LIST_DIR}/global_allocator.cpp
  ${CMAKE_CURRENT_LIST_DIR}/gpu_backends.cpp
  ${CMAKE_CURRENT_LIST_DIR}/host_memory.cpp
  ${CMAKE_CURRENT_LIST_DIR}/resources.cpp
  ${CMAKE_CURRENT_LIST_DIR}/staged_copy.cpp
)
if(APRIL_CUDA_INCLUDE)
  target_compile_definitions(april_core PUBLIC APRIL_EXT_WITH_CUDA=1)
  target_sources(april_core PRIVATE ${CMAKE_CURRENT_LIST_DIR}/cuda_backend.cpp)
  # Driver headers only for the backend source: the rest of the core stays toolkit-independent.
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/cuda_backend.cpp PROPERTIES
    INCLUDE_DIRECTORIES "${APRIL_CUDA_INCLUDE}")
endif()
if(APRIL_HIP_INCLUDE)
  target_compile_definitions(april_core PUBLIC APRIL_EXT_WITH_HIP=1)
  target_sources(april_core PRIVATE ${CMAKE_CURRENT_LIST_DIR}/hip_backend.cpp)
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/hip_backend.cpp PROPERTIES
    INCLUDE_DIRECTORIES "${APRIL_HIP_INCLUDE}"
    COMPILE_DEFINITIONS "__HIP_PLATFORM_AMD__")
endif()
