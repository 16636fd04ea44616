// april_ext._C.SchedulerConfig (april::sched::Config) and april_ext._C.SchedulerCore: converts Python values and
// numpy arrays and forwards to april::sched::Scheduler.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "common/error.h"
#include "scheduler/names.h"
#include "scheduler/scheduler.h"

namespace py = pybind11;

namespace april::bindings {

namespace {

using sched::Config;
using sched::Scheduler;

template <typename T>
using Array = py::array_t<T, py::array::c_style | py::array::forcecast>;

// Hands the vector's buffer to numpy without a copy; the capsule frees it with the array.
template <typename T>
py::array_t<T> to_numpy(std::vector<T>&& v) {
  auto* heap = new std::vector<T>(std::move(v));
  py::capsule owner(heap, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>({static_cast<py::ssize_t>(heap->size())}, {static_cast<py::ssize_t>(sizeof(T))},
                        heap->data(), owner);
}

// f() with the GIL released, for the core calls that carry bulk data.
template <typename F>
auto without_gil(F&& f) {
  py::gil_scoped_release nogil;
  return f();
}

// Puts each (name, vector) pair into `out`, the vector as a numpy array (see to_numpy).
void put(py::dict&) {}
template <typename T, typename... Rest>
void put(py::dict& out, const char* name, std::vector<T>& v, Rest&&... rest) {
  out[name] = to_numpy(std::move(v));
  put(out, std::forward<Rest>(rest)...);
}

// Python value -> Config field, with Python's types: false for a value of another type, which the field refuses
// (pybind11's casters would take True for an int and, converting, 1 for a bool).
bool load(const py::handle& v, int64_t& out) {
  py::detail::make_caster<int64_t> caster;
  if (PyBool_Check(v.ptr()) || !caster.load(v, /*convert=*/false)) return false;
  out = static_cast<int64_t>(caster);
  return true;
}

bool load(const py::handle& v, std::optional<int64_t>& out) {
  if (v.is_none()) {
    out.reset();
    return true;
  }
  int64_t value = 0;
  if (!load(v, value)) return false;
  out = value;
  return true;
}

bool load(const py::handle& v, bool& out) {
  if (!PyBool_Check(v.ptr())) return false;
  out = v.ptr() == Py_True;
  return true;
}

template <typename E, typename = std::enable_if_t<std::is_enum_v<E>>>
bool load(const py::handle& v, E& out) {
  return py::isinstance<py::str>(v) && sched::parse(v.cast<std::string>(), out);
}

// A Config field as a Python attribute: enums by name, unset optionals as None.
template <typename T>
void def_field(py::class_<Config>& cls, const char* name, T Config::*field) {
  cls.def_property(
      name,
      [field](const Config& c) {
        if constexpr (std::is_enum_v<T>) {
          return py::cast(sched::name_of(c.*field));
        } else {
          return py::cast(c.*field);
        }
      },
      [name, field](Config& c, const py::handle& value) {
        if (!load(value, c.*field)) c.refuse(name, py::repr(value));
      });
}

template <typename T>
void require_1d(const Array<T>& a, const char* name) {
  check(a.ndim() == 1, ErrorKind::InvalidArgument,
        std::string(name) + " must be a 1-D array, got " + std::to_string(a.ndim()) + " dimensions");
}

// The engine's arrays as they are: data and length of a 1-D C-contiguous, aligned numpy array of T (or an
// equivalent type) in native byte order, or nullptr for anything else (the Python face converts it and calls
// again). No copy, no new array, no call into numpy: the checks read the array's header, since every token call
// pays for them.
template <typename T>
const T* exact(const py::handle& h, size_t& size) {
  if (!py::isinstance<py::array>(h)) return nullptr;
  const auto* a = py::detail::array_proxy(h.ptr());
  constexpr int kLayout = py::array::c_style | py::detail::npy_api::NPY_ARRAY_ALIGNED_;
  if (a->nd != 1 || (a->flags & kLayout) != kLayout) return nullptr;
  const auto dtype = py::reinterpret_borrow<py::dtype>(a->descr);
  constexpr char kNative = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ ? '<' : '>';
  const char order = dtype.byteorder();  // '=' native, '|' not applicable
  if (dtype.normalized_num() != py::dtype::num_of<T>() || (order != '=' && order != '|' && order != kNative)) {
    return nullptr;
  }
  size = static_cast<size_t>(a->dimensions[0]);
  return reinterpret_cast<const T*>(a->data);
}

// False when an array is not exact (see exact()); the lengths are checked here, the values by the core.
bool events(sched::EventBatch& ev, const py::handle& ids, const py::handle& counts, const py::handle& tokens,
            const py::handle& logprobs, const py::handle& versions) {
  size_t n_counts = 0, n_versions = 0;
  ev.sample_ids = exact<int64_t>(ids, ev.n_events);
  ev.counts = exact<int64_t>(counts, n_counts);
  ev.versions = exact<int64_t>(versions, n_versions);
  ev.tokens = exact<int32_t>(tokens, ev.n_tokens);
  ev.logprobs = exact<float>(logprobs, ev.n_logprobs);
  if (!ev.sample_ids || !ev.counts || !ev.versions || !ev.tokens || !ev.logprobs) return false;
  if (n_counts != ev.n_events || n_versions != ev.n_events) {
    throw Error(ErrorKind::InvalidArgument, "sample_ids, counts and versions must have the same length, got " +
                                                std::to_string(ev.n_events) + ", " + std::to_string(n_counts) + ", " +
                                                std::to_string(n_versions));
  }
  return true;
}

}  // namespace

void bind_scheduler(py::module_& m) {
  m.def("scheduler_config_choices", [] {
    py::dict out;
    for (const auto& [field, names] : sched::config_choices()) out[py::str(field)] = py::tuple(py::cast(names));
    return out;
  });
  // The fields in declaration order; a value of the wrong type raises ConfigError, and validated() checks the rest.
  py::class_<Config> config(m, "SchedulerConfig");
  config.def(py::init<>()).def("validated", &Config::validated);
  def_field(config, "rollout_batch_size", &Config::rollout_batch_size);
  def_field(config, "n_samples_per_prompt", &Config::n_samples_per_prompt);
  def_field(config, "over_sampling_batch_size", &Config::over_sampling_batch_size);
  def_field(config, "max_response_len", &Config::max_response_len);
  def_field(config, "refill", &Config::refill);
  def_field(config, "max_staleness", &Config::max_staleness);
  def_field(config, "staleness_policy", &Config::staleness_policy);
  def_field(config, "mask_offpolicy", &Config::mask_offpolicy);
  def_field(config, "resume_order", &Config::resume_order);
  def_field(config, "keep_surplus", &Config::keep_surplus);
  def_field(config, "max_inflight_samples", &Config::max_inflight_samples);
  def_field(config, "over_sampling", &Config::over_sampling);
  def_field(config, "target_inflight_samples", &Config::target_inflight_samples);
  def_field(config, "step_boundary", &Config::step_boundary);
  def_field(config, "dispatch_order", &Config::dispatch_order);
  def_field(config, "resume_priority", &Config::resume_priority);
  def_field(config, "chunk_tokens", &Config::chunk_tokens);
  def_field(config, "tail_batching", &Config::tail_batching);
  def_field(config, "tail_batching_restart", &Config::tail_batching_restart);
  def_field(config, "tail_extra_samples", &Config::tail_extra_samples);
  py::class_<Scheduler>(m, "SchedulerCore")
      .def(py::init<const Config&>())
      .def("set_data_size", &Scheduler::set_data_size)
      .def("prompts_consumed", &Scheduler::prompts_consumed)
      .def("policy_version", &Scheduler::policy_version)
      .def("begin_step", &Scheduler::begin_step)
      .def("step_open", &Scheduler::step_open)
      .def("step_done", &Scheduler::step_done)
      .def("samples_to_abort", [](Scheduler& s) { return to_numpy(s.samples_to_abort()); })
      .def("groups_to_launch", &Scheduler::groups_to_launch)
      .def("add_groups",
           [](Scheduler& s, int64_t first_index, const Array<int32_t>& tokens, const Array<int64_t>& offsets,
              const std::optional<Array<int64_t>>& history_keys) {
             require_1d(tokens, "prompt tokens");
             require_1d(offsets, "prompt offsets");
             check(offsets.size() >= 1, ErrorKind::InvalidArgument, "prompt offsets need at least one entry (0)");
             sched::PromptBatch p;
             p.first_index = first_index;
             p.tokens = tokens.data();
             p.n_tokens = static_cast<size_t>(tokens.size());
             p.offsets = offsets.data();
             p.n_groups = static_cast<size_t>(offsets.size() - 1);
             if (history_keys) {
               require_1d(*history_keys, "history keys");
               check(static_cast<size_t>(history_keys->size()) == p.n_groups, ErrorKind::InvalidArgument,
                     "history keys has " + std::to_string(history_keys->size()) + " entries for " +
                         std::to_string(p.n_groups) + " prompts: one key per prompt");
               p.history_keys = history_keys->data();
             }
             s.add_groups(p);
           },
           py::arg("first_index"), py::arg("tokens"), py::arg("offsets"), py::arg("history_keys") = py::none())
      .def("dispatch",
           [](Scheduler& s) {
             sched::Dispatch d = without_gil([&] { return s.dispatch(); });
             py::dict out;
             put(out, "sample_ids", d.sample_ids, "group_ids", d.group_ids, "prompt_indices", d.prompt_indices,
                 "input_ids", d.input_ids, "offsets", d.offsets, "prompt_lens", d.prompt_lens, "max_new_tokens",
                 d.max_new_tokens, "is_resume", d.is_resume, "is_continuation", d.is_continuation, "predicted_lens",
                 d.predicted_lens);
             return out;
           })
      // Event calls return False, having done nothing, unless every array is exact (see exact()).
      .def("on_tokens",
           [](Scheduler& s, const py::handle& ids, const py::handle& counts, const py::handle& tokens,
              const py::handle& logprobs, const py::handle& versions) {
             sched::EventBatch ev;
             if (!events(ev, ids, counts, tokens, logprobs, versions)) return false;
             py::gil_scoped_release nogil;
             s.on_tokens(ev);
             return true;
           })
      .def("on_finish",
           [](Scheduler& s, const py::handle& ids, const py::handle& reasons, const py::handle& counts,
              const py::handle& tokens, const py::handle& logprobs, const py::handle& versions) {
             sched::EventBatch ev;
             size_t n_reasons = 0;
             ev.reasons = exact<uint8_t>(reasons, n_reasons);
             if (!events(ev, ids, counts, tokens, logprobs, versions) || !ev.reasons) return false;
             if (n_reasons != ev.n_events) {
               throw Error(ErrorKind::InvalidArgument, "reasons has " + std::to_string(n_reasons) +
                                                           " entries, sample_ids has " + std::to_string(ev.n_events) +
                                                           ": one finish reason per sample");
             }
             py::gil_scoped_release nogil;
             s.on_finish(ev);
             return true;
           })
      .def("on_env_tokens",
           [](Scheduler& s, const py::handle& ids, const py::handle& counts, const py::handle& tokens) {
             sched::EventBatch ev;
             size_t n_counts = 0;
             ev.sample_ids = exact<int64_t>(ids, ev.n_events);
             ev.counts = exact<int64_t>(counts, n_counts);
             ev.tokens = exact<int32_t>(tokens, ev.n_tokens);
             if (!ev.sample_ids || !ev.counts || !ev.tokens) return false;
             if (n_counts != ev.n_events) {
               throw Error(ErrorKind::InvalidArgument, "sample_ids and counts must have the same length, got " +
                                                           std::to_string(ev.n_events) + " and " +
                                                           std::to_string(n_counts));
             }
             py::gil_scoped_release nogil;
             s.on_env_tokens(ev);
             return true;
           })
      .def("pop_completed_groups",
           [](Scheduler& s) {
             py::list out;
             for (auto& c : s.pop_completed_groups()) {
               out.append(py::make_tuple(c.group_id, c.prompt_index, to_numpy(std::move(c.sample_ids)),
                                         to_numpy(std::move(c.response_lens)), to_numpy(std::move(c.finish_reasons)),
                                         to_numpy(std::move(c.tokens))));
             }
             return out;
           })
      .def("report_rewards",
           [](Scheduler& s, int64_t group_id, const Array<float>& rewards, bool accepted) {
             require_1d(rewards, "rewards");
             s.report_rewards(group_id, rewards.data(), static_cast<size_t>(rewards.size()), accepted);
           })
      .def("take_batch",
           [](Scheduler& s) {
             sched::Batch b = without_gil([&] { return s.take_batch(); });
             py::dict out;
             put(out, "tokens", b.tokens, "offsets", b.offsets, "prompt_lens", b.prompt_lens, "loss_mask", b.loss_mask,
                 "behavior_logprobs", b.behavior_logprobs, "versions", b.versions, "rewards", b.rewards,
                 "group_index", b.group_index, "sample_ids", b.sample_ids, "finish_reasons", b.finish_reasons,
                 "group_ids", b.group_ids, "prompt_indices", b.prompt_indices);
             out["policy_version"] = b.policy_version;
             return out;
           })
      .def("stats",
           [](const Scheduler& s) {
             const sched::StepStats st = s.stats();
             return py::make_tuple(st.counters(), st.staleness_histogram, st.prediction_rank_corr);
           })
      .def("buffered_memory",
           [](const Scheduler& s) {
             const sched::MemoryUsage m = s.buffered_memory();
             return py::make_tuple(m.samples, m.tokens, m.bytes);
           })
      .def("sample_ids",
           [](const Scheduler& s, const std::string& state) {
             return to_numpy(s.sample_ids(sched::parse_sample_state(state)));
           })
      .def("sample_response",
           [](const Scheduler& s, int64_t sample_id) {
             std::vector<int32_t> tokens, versions;
             std::vector<float> logprobs;
             std::vector<uint8_t> env_mask;
             sched::SampleState state = sched::SampleState::Queued;
             int64_t resumes = 0;
             s.sample_response(sample_id, tokens, logprobs, versions, env_mask, state, resumes);
             return py::make_tuple(to_numpy(std::move(tokens)), to_numpy(std::move(logprobs)),
                                   to_numpy(std::move(versions)), sched::name_of(state), resumes,
                                   to_numpy(std::move(env_mask)));
           })
      .def("serialize",
           [](const Scheduler& s) { return py::bytes(without_gil([&] { return s.serialize(); })); })
      .def("deserialize",
           [](Scheduler& s, const py::bytes& data) {
             std::string bytes = data;
             py::gil_scoped_release nogil;
             s.deserialize(bytes);
           })
      .def("save", &Scheduler::save, py::call_guard<py::gil_scoped_release>())
      .def("load", &Scheduler::load, py::call_guard<py::gil_scoped_release>());
}

}  // namespace april::bindings
