# Scheduler sources, compiled into april_core.
target_sources(april_core PRIVATE
  csrc/scheduler/config.cpp
  csrc/scheduler/dispatch.cpp
  csrc/scheduler/events.cpp
  csrc/scheduler/groups.cpp
  csrc/scheduler/names.cpp
  csrc/scheduler/prediction.cpp
  csrc/scheduler/sample_index.cpp
  csrc/scheduler/scheduler.cpp
  csrc/scheduler/staleness.cpp
  csrc/scheduler/state_file.cpp
  csrc/scheduler/state_io.cpp
  csrc/scheduler/step.cpp
  csrc/scheduler/tail.cpp
)
