// april_ext._C.SchedulerCore: converts numpy arrays and forwards to april::sched::Scheduler.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "common/error.h"
#include "scheduler/names.h"
#include "scheduler/scheduler.h"

namespace py = pybind11;

namespace april::bindings {

namespace {

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
  py::class_<Scheduler>(m, "SchedulerCore")
      .def(py::init([](int64_t rollout_batch_size, int64_t n_samples_per_prompt, int64_t over_sampling_batch_size,
                       int64_t max_response_len, const std::string& refill, int64_t max_staleness,
                       const std::string& staleness_policy, bool mask_offpolicy, const std::string& resume_order,
                       bool keep_surplus, int64_t max_inflight_samples, const std::string& over_sampling,
                       int64_t target_inflight_samples, const std::string& step_boundary,
                       const std::string& dispatch_order, bool resume_priority, int64_t chunk_tokens,
                       bool tail_batching, bool tail_batching_restart, int64_t tail_extra_samples) {
             sched::Config c;
             c.rollout_batch_size = rollout_batch_size;
             c.n_samples_per_prompt = n_samples_per_prompt;
             c.over_sampling_batch_size = over_sampling_batch_size;
             c.max_response_len = max_response_len;
             c.refill = sched::parse_refill(refill);
             c.max_staleness = max_staleness;
             c.staleness_policy = sched::parse_staleness_policy(staleness_policy);
             c.mask_offpolicy = mask_offpolicy;
             c.resume_order = sched::parse_resume_order(resume_order);
             c.keep_surplus = keep_surplus;
             c.max_inflight_samples = max_inflight_samples;
             c.over_sampling = sched::parse_over_sampling(over_sampling);
             c.target_inflight_samples = target_inflight_samples;
             c.step_boundary = sched::parse_step_boundary(step_boundary);
             c.dispatch_order = sched::parse_dispatch_order(dispatch_order);
             c.resume_priority = resume_priority;
             c.chunk_tokens = chunk_tokens;
             c.tail_batching = tail_batching;
             c.tail_batching_restart = tail_batching_restart;
             c.tail_extra_samples = tail_extra_samples;
             return new Scheduler(c);
           }),
           py::arg("rollout_batch_size"), py::arg("n_samples_per_prompt"), py::arg("over_sampling_batch_size"),
           py::arg("max_response_len"), py::arg("refill"), py::arg("max_staleness"), py::arg("staleness_policy"),
           py::arg("mask_offpolicy"), py::arg("resume_order"), py::arg("keep_surplus"),
           py::arg("max_inflight_samples"), py::arg("over_sampling") = "fixed", py::arg("target_inflight_samples") = 0,
           py::arg("step_boundary") = "abort", py::arg("dispatch_order") = "fifo", py::arg("resume_priority") = true,
           py::arg("chunk_tokens") = 0, py::arg("tail_batching") = false, py::arg("tail_batching_restart") = false,
           py::arg("tail_extra_samples") = 0)
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
             sched::Dispatch d;
             {
               py::gil_scoped_release nogil;
               d = s.dispatch();
             }
             py::dict out;
             out["sample_ids"] = to_numpy(std::move(d.sample_ids));
             out["group_ids"] = to_numpy(std::move(d.group_ids));
             out["prompt_indices"] = to_numpy(std::move(d.prompt_indices));
             out["input_ids"] = to_numpy(std::move(d.input_ids));
             out["offsets"] = to_numpy(std::move(d.offsets));
             out["prompt_lens"] = to_numpy(std::move(d.prompt_lens));
             out["max_new_tokens"] = to_numpy(std::move(d.max_new_tokens));
             out["is_resume"] = to_numpy(std::move(d.is_resume));
             out["is_continuation"] = to_numpy(std::move(d.is_continuation));
             out["predicted_lens"] = to_numpy(std::move(d.predicted_lens));
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
             sched::Batch b;
             {
               py::gil_scoped_release nogil;
               b = s.take_batch();
             }
             py::dict out;
             out["tokens"] = to_numpy(std::move(b.tokens));
             out["offsets"] = to_numpy(std::move(b.offsets));
             out["prompt_lens"] = to_numpy(std::move(b.prompt_lens));
             out["loss_mask"] = to_numpy(std::move(b.loss_mask));
             out["behavior_logprobs"] = to_numpy(std::move(b.behavior_logprobs));
             out["versions"] = to_numpy(std::move(b.versions));
             out["rewards"] = to_numpy(std::move(b.rewards));
             out["group_index"] = to_numpy(std::move(b.group_index));
             out["sample_ids"] = to_numpy(std::move(b.sample_ids));
             out["finish_reasons"] = to_numpy(std::move(b.finish_reasons));
             out["group_ids"] = to_numpy(std::move(b.group_ids));
             out["prompt_indices"] = to_numpy(std::move(b.prompt_indices));
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
             sched::SampleState state = sched::SampleState::Queued;
             int64_t resumes = 0;
             s.sample_response(sample_id, tokens, logprobs, versions, state, resumes);
             return py::make_tuple(to_numpy(std::move(tokens)), to_numpy(std::move(logprobs)),
                                   to_numpy(std::move(versions)), sched::name_of(state), resumes);
           })
      .def("serialize",
           [](const Scheduler& s) {
             std::string bytes;
             {
               py::gil_scoped_release nogil;
               bytes = s.serialize();
             }
             return py::bytes(bytes);
           })
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
