# Scheduler sources, compiled into april_core.
target_sources(april_core PRIVATE
)
