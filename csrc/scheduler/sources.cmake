# Scheduler sources, compiled into april_core.
target_sources(april_core PRIVATE
  csrc/scheduler/config.cpp
  csrc/scheduler/scheduler.cpp
  csrc/scheduler/state_io.cpp
)
