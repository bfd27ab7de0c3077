// ascendspeed::set_flush_subnormals: FTZ/DAZ (flush_subnormals.h) for a region of Python code that runs
// torch's own kernels, such as Megatron's softmax on ALiBi scores. The mode is per thread, so it is set
// on the calling thread and on every thread of torch's intra-op pool (torch.set_flush_denormal sets the
// calling thread only).
#include "flush_subnormals.h"

#include <ATen/Parallel.h>
#include <ATen/core/List.h>
#include <torch/library.h>

#include <vector>

namespace ascendspeed::cpu {
namespace {

// Runs `body(thread)` once on each intra-op thread. With the OpenMP backend a range of one item per
// thread and a grain of one gives every thread of the team exactly one item; with the native thread
// pool items may share a thread, so the calling thread's own call below is what torch guarantees.
template <typename Body>
void on_every_intra_op_thread(const Body& body) {
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t thread = begin; thread < end; ++thread) {
      body(thread);
    }
  });
}

bool set_flush_subnormals(bool enabled) {
  const bool previous = flush_subnormals_on_this_thread();
  on_every_intra_op_thread([&](int64_t) { set_flush_subnormals_on_this_thread(enabled); });
  set_flush_subnormals_on_this_thread(enabled);
  return previous;
}

// The mode of the calling thread, then of each intra-op thread (for tests).
c10::List<bool> flush_subnormals_states() {
  std::vector<char> pool(at::get_num_threads(), 0);
  on_every_intra_op_thread([&](int64_t thread) { pool[thread] = flush_subnormals_on_this_thread(); });
  c10::List<bool> states({flush_subnormals_on_this_thread()});
  for (const char state : pool) {
    states.push_back(state != 0);
  }
  return states;
}

} // namespace
} // namespace ascendspeed::cpu

TORCH_LIBRARY_FRAGMENT(ascendspeed, m) {
  m.set_python_module("ascendspeed.ops.subnormals");
  m.def("set_flush_subnormals(bool enabled) -> bool", &ascendspeed::cpu::set_flush_subnormals);
  m.def("_flush_subnormals_states() -> bool[]", &ascendspeed::cpu::flush_subnormals_states);
}
