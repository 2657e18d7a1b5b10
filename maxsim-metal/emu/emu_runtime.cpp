// Runtime of the Metal emulator: runs the threadgroups of a launch, each of
// its SIMT threads as a fiber (cooperative, one OS thread per worker) or as an
// OS thread, with real barriers for threadgroup_barrier and for the
// per-SIMD-group exchanges. See metal_emu.h.
#include "metal_emu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__linux__) || defined(__APPLE__))
#define EMU_NATIVE_SWITCH 1
#else
#define EMU_NATIVE_SWITCH 0
#endif
#if defined(__linux__)
#include <ucontext.h>
#define EMU_HAVE_UCONTEXT 1
#else
#define EMU_HAVE_UCONTEXT 0
#endif

// ---------------------------------------------------------------------------
// x86-64 context switch: saves the callee-saved registers, MXCSR and the x87
// control word on the current stack, stores the stack pointer in *from_sp and
// resumes the context whose stack pointer is to_sp. A new context starts in
// emu_fiber_start with r12 = argument, r13 = function.
// ---------------------------------------------------------------------------
#if EMU_NATIVE_SWITCH
#if defined(__APPLE__)
#define EMU_SYM(x) "_" #x
#define EMU_FUNC_TYPE(x) ""
#define EMU_NOTE_STACK ""
#else
#define EMU_SYM(x) #x
#define EMU_FUNC_TYPE(x) ".type " #x ",@function\n"
#define EMU_NOTE_STACK ".section .note.GNU-stack,\"\",@progbits\n"
#endif
extern "C" void emu_ctx_switch(void** from_sp, void* to_sp);
extern "C" void emu_fiber_start();
asm(".text\n"
    ".p2align 4\n"
    ".globl " EMU_SYM(emu_ctx_switch) "\n" EMU_FUNC_TYPE(emu_ctx_switch)
    EMU_SYM(emu_ctx_switch) ":\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  subq $8, %rsp\n"
    "  stmxcsr (%rsp)\n"
    "  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n"
    "  fldcw 4(%rsp)\n"
    "  addq $8, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".p2align 4\n"
    ".globl " EMU_SYM(emu_fiber_start) "\n" EMU_FUNC_TYPE(emu_fiber_start)
    EMU_SYM(emu_fiber_start) ":\n"
    "  movq %r12, %rdi\n"
    "  callq *%r13\n"
    "  ud2\n"
    EMU_NOTE_STACK
    ".text\n");
#endif

namespace emu {

// ===========================================================================
// State
// ===========================================================================
struct Barrier {
  int expected = 0;
  int count = 0;
  unsigned long gen = 0;
  std::mutex mu;                // OS-thread mode only
  std::condition_variable cv;   // OS-thread mode only
};

struct SimdShared {
  alignas(16) unsigned char slot[2][32][64];
  unsigned long tag[32];  // (sequence number << 8) | operation, per lane
  Barrier bar;
};

struct Fiber;
struct Worker;

struct LaunchState {
  const Launch* launch = nullptr;
  void (*kernel)() = nullptr;
  long threads = 0;
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  std::string error;
  bool os_threads = false;
  std::vector<Barrier*> all_barriers;  // OS-thread mode: woken on failure
};

struct GroupShared {
  long pos[3] = {0, 0, 0};
  std::vector<unsigned char> smem;  // requested bytes + guard
  size_t smem_bytes = 0;
  Barrier bar;
  std::vector<unsigned long> tg_tag;  // per thread: threadgroup barriers passed
  std::unique_ptr<SimdShared[]> simd;
  int nsimd = 0;
};

struct ThreadCtx {
  LaunchState* st = nullptr;
  GroupShared* group = nullptr;
  SimdShared* sg = nullptr;
  Fiber* fiber = nullptr;  // null in OS-thread mode
  unsigned tid = 0, lane = 0, sgid = 0;
  unsigned long simd_seq = 0;
  unsigned long tg_seq = 0;
};

static thread_local ThreadCtx* tls_ctx = nullptr;

// Error messages are concatenated strings, not iostreams: building one with
// std::ostringstream crashed (SIGSEGV) in this extension on Ubuntu 24.04 /
// GCC 13 next to torch 2.11, where plain std::string works.
static std::string piece(const std::string& s) { return s; }
static std::string piece(const char* s) { return s; }
template <class T, class = std::enable_if_t<std::is_arithmetic<T>::value>>
static std::string piece(T v) {
  return std::to_string(v);
}
template <class... A>
static std::string cat(const A&... a) {
  std::string s;
  ((s += piece(a)), ...);
  return s;
}
static constexpr size_t kGuard = 256;
static constexpr unsigned char kGuardByte = 0xA5;

ThreadCtx* current() {
  if (!tls_ctx) throw std::runtime_error("emu: Metal builtin called outside an emulated kernel");
  return tls_ctx;
}
unsigned lane_of(const ThreadCtx& c) { return c.lane; }

Config& config() {
  static Config c;
  return c;
}
bool fibers_native() { return EMU_NATIVE_SWITCH != 0; }

// --------------------------------------------------------------- registry --
namespace {
struct Registry {
  std::mutex mu;
  std::map<std::string, void (*)()> kernels;
  std::map<std::string, long> counts;
};
Registry& registry() {
  static Registry r;
  return r;
}
}  // namespace

Registrar::Registrar(const char* name, void (*fn)()) {
  std::lock_guard<std::mutex> g(registry().mu);
  registry().kernels[name] = fn;
  registry().counts[name] = 0;
}
std::vector<std::string> kernel_names() {
  std::lock_guard<std::mutex> g(registry().mu);
  std::vector<std::string> v;
  for (auto& kv : registry().kernels) v.push_back(kv.first);
  return v;
}
std::map<std::string, long> launch_counts() {
  std::lock_guard<std::mutex> g(registry().mu);
  return registry().counts;
}

void Launch::set_buffer(int index, const void* ptr, size_t bytes) {
  if (index < 0 || index >= kMaxBuffers) throw std::runtime_error("emu: buffer index out of range");
  Binding& b = buffers[index];
  b.ptr = ptr, b.bytes = bytes, b.set = true, b.is_bytes = false;
  b.data.clear();
}
void Launch::set_bytes(int index, const void* ptr, size_t bytes) {
  if (index < 0 || index >= kMaxBuffers) throw std::runtime_error("emu: buffer index out of range");
  if (bytes > 4096) throw std::runtime_error("emu: setBytes is limited to 4 KiB");
  Binding& b = buffers[index];
  b.data.assign(static_cast<const unsigned char*>(ptr), static_cast<const unsigned char*>(ptr) + bytes);
  b.ptr = b.data.data(), b.bytes = bytes, b.set = true, b.is_bytes = true;
}

// ===========================================================================
// Fibers
// ===========================================================================
struct Fiber {
  void* sp = nullptr;
#if EMU_HAVE_UCONTEXT
  ucontext_t uc;
#endif
  unsigned char* stack = nullptr;  // mapping including the guard page
  size_t map_bytes = 0;
  ThreadCtx ctx;
  bool done = false;
  Barrier* wait = nullptr;
  unsigned long wait_gen = 0;
  Worker* worker = nullptr;
  int index = 0;
};

static void fiber_main(Fiber* f);

struct Worker {
  LaunchState* st = nullptr;
  bool native = true;
  std::vector<std::unique_ptr<Fiber>> fibers;
  int cur = -1;
  void* main_sp = nullptr;
#if EMU_HAVE_UCONTEXT
  ucontext_t main_uc;
#endif
  static constexpr size_t kStack = 256 * 1024;

  ~Worker() {
    for (auto& f : fibers)
      if (f->stack) munmap(f->stack, f->map_bytes);
  }

  void ensure(int n) {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    while (int(fibers.size()) < n) {
      auto f = std::make_unique<Fiber>();
      f->map_bytes = kStack + page;
      void* m = mmap(nullptr, f->map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) throw std::runtime_error("emu: cannot map a fiber stack");
      f->stack = static_cast<unsigned char*>(m);
      mprotect(f->stack, page, PROT_NONE);  // stack overflow -> fault, not corruption
      f->worker = this;
      f->index = int(fibers.size());
      fibers.push_back(std::move(f));
    }
  }

  void prepare(Fiber* f) {
    f->done = false;
    f->wait = nullptr;
    unsigned char* top = f->stack + f->map_bytes;
    if (native) {
#if EMU_NATIVE_SWITCH
      uintptr_t a = (reinterpret_cast<uintptr_t>(top) - 64) & ~uintptr_t(15);  // 16-aligned after `ret`
      uint64_t* sp = reinterpret_cast<uint64_t*>(a - 64);
      uint32_t mxcsr;
      uint16_t fcw;
      asm volatile("stmxcsr %0" : "=m"(mxcsr));
      asm volatile("fnstcw %0" : "=m"(fcw));
      std::memset(sp, 0, 64);
      std::memcpy(reinterpret_cast<unsigned char*>(sp), &mxcsr, 4);
      std::memcpy(reinterpret_cast<unsigned char*>(sp) + 4, &fcw, 2);
      sp[1] = 0;                                          // r15
      sp[2] = 0;                                          // r14
      sp[3] = reinterpret_cast<uint64_t>(&fiber_main);    // r13: function
      sp[4] = reinterpret_cast<uint64_t>(f);              // r12: argument
      sp[5] = 0;                                          // rbx
      sp[6] = 0;                                          // rbp
      sp[7] = reinterpret_cast<uint64_t>(&emu_fiber_start);  // return address
      f->sp = sp;
#endif
    } else {
#if EMU_HAVE_UCONTEXT
      getcontext(&f->uc);
      f->uc.uc_stack.ss_sp = f->stack + (f->map_bytes - kStack);
      f->uc.uc_stack.ss_size = kStack;
      f->uc.uc_link = nullptr;
      const uintptr_t p = reinterpret_cast<uintptr_t>(f);
      makecontext(&f->uc, reinterpret_cast<void (*)()>(&Worker::uc_entry), 2, unsigned(p >> 32),
                  unsigned(p & 0xffffffffu));
#endif
    }
  }

#if EMU_HAVE_UCONTEXT
  static void uc_entry(unsigned hi, unsigned lo) {
    fiber_main(reinterpret_cast<Fiber*>((uintptr_t(hi) << 32) | uintptr_t(lo)));
  }
#endif

  // from == nullptr: the worker's own context; to == nullptr: back to it.
  void switch_to(Fiber* from, Fiber* to) {
    tls_ctx = to ? &to->ctx : nullptr;
    cur = to ? to->index : -1;
    if (native) {
#if EMU_NATIVE_SWITCH
      emu_ctx_switch(from ? &from->sp : &main_sp, to ? to->sp : main_sp);
#endif
    } else {
#if EMU_HAVE_UCONTEXT
      swapcontext(from ? &from->uc : &main_uc, to ? &to->uc : &main_uc);
#endif
    }
  }

  bool runnable(const Fiber* f) const {
    if (f->done) return false;
    if (!f->wait) return true;
    return st->failed.load() || f->wait->gen != f->wait_gen;
  }

  // Next fiber to run after `from` (round robin, `from` itself last);
  // nullptr when every fiber has finished. A state where fibers remain but
  // none can run is a deadlock: the launch fails and the fibers unwind.
  Fiber* pick(int from, int n) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      bool pending = false;
      if (rng != 0) {  // random schedule: any runnable fiber
        int cand[1024];
        int nc = 0;
        for (int i = 0; i < n; ++i) {
          Fiber* f = fibers[size_t(i)].get();
          if (runnable(f)) cand[nc++] = i;
          if (!f->done) pending = true;
        }
        if (nc > 0) {
          rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;  // xorshift64
          return fibers[size_t(cand[rng % uint64_t(nc)])].get();
        }
      } else {
        for (int k = 1; k <= n; ++k) {
          Fiber* f = fibers[size_t((from + k) % n)].get();
          if (runnable(f)) return f;
          if (!f->done) pending = true;
        }
      }
      if (!pending) return nullptr;
      std::string msg =
          "deadlock: threads of threadgroup wait at barriers that cannot complete "
          "(a barrier or SIMD-group operation not reached by every thread):";
      int shown = 0;
      for (int i = 0; i < n && shown < 8; ++i) {
        const Fiber* f = fibers[size_t(i)].get();
        if (f->done) continue;
        ++shown;
        const bool at_tg = f->wait == &f->ctx.group->bar;
        msg += cat(" [thread ", i, at_tg ? " at threadgroup_barriers#" : " at simd op#",
                   at_tg ? f->ctx.tg_seq : f->ctx.simd_seq, "]");
      }
      record_failure(msg);
    }
    return nullptr;
  }

  void record_failure(const std::string& msg) {
    std::lock_guard<std::mutex> g(st->err_mu);
    if (!st->failed.load()) {
      st->error = msg;
      st->failed.store(true);
    }
  }

  void block(Fiber* f) {
    Fiber* nxt = pick(f->index, int(fibers_in_group));
    if (nxt == f) return;
    if (!nxt) {  // cannot happen for a blocked fiber (it is not done)
      switch_to(f, nullptr);
      return;
    }
    switch_to(f, nxt);
  }

  [[noreturn]] void finish(Fiber* f) {
    f->done = true;
    Fiber* nxt = pick(f->index, int(fibers_in_group));
    switch_to(f, nxt);  // nxt == nullptr: back to the worker
    std::abort();       // a finished fiber is never resumed
  }

  size_t fibers_in_group = 0;
  uint64_t rng = 0;  // 0: round robin

  void run_group(GroupShared& g, long index) {
    const int n = int(st->threads);
    ensure(n);
    const unsigned sched = config().schedule;
    rng = sched ? (uint64_t(sched) * 0x9E3779B97F4A7C15ull) ^ (uint64_t(index + 1) * 0xBF58476D1CE4E5B9ull) : 0;
    if (sched && rng == 0) rng = 1;
    fibers_in_group = size_t(n);
    for (int t = 0; t < n; ++t) {
      Fiber* f = fibers[size_t(t)].get();
      prepare(f);
      ThreadCtx& c = f->ctx;
      c = ThreadCtx();
      c.st = st, c.group = &g, c.fiber = f;
      c.tid = unsigned(t), c.lane = unsigned(t % 32), c.sgid = unsigned(t / 32);
      c.sg = &g.simd[size_t(t / 32)];
    }
    switch_to(nullptr, rng ? fibers[size_t(rng % uint64_t(n))].get() : fibers[0].get());
    // back on the worker's stack: every fiber finished (or unwound)
  }
};

static void fiber_main(Fiber* f) {
  try {
    f->worker->st->kernel();
  } catch (const Abort&) {
  } catch (const std::exception& e) {
    f->worker->record_failure(std::string("exception in kernel: ") + e.what());
  } catch (...) {
    f->worker->record_failure("unknown exception in kernel");
  }
  f->worker->finish(f);
}

// ===========================================================================
// Failure, barriers
// ===========================================================================
static void set_failed(LaunchState* st, const std::string& msg) {
  {
    std::lock_guard<std::mutex> g(st->err_mu);
    if (!st->failed.load()) {
      st->error = msg;
      st->failed.store(true);
    }
  }
  if (st->os_threads)
    for (Barrier* b : st->all_barriers) {
      std::lock_guard<std::mutex> g(b->mu);
      b->cv.notify_all();
    }
}

void fail(const std::string& msg) {
  ThreadCtx* c = tls_ctx;
  if (c) {
    set_failed(c->st, cat(msg, " (threadgroup ", c->group->pos[0], ",", c->group->pos[1], ",", c->group->pos[2],
                          ", thread ", c->tid, ")"));
  }
  throw Abort{};
}

// Arrive at `b`; the last arrival runs `check` (returns an error message, or
// an empty string) before anyone is released, then releases the others.
template <class Check>
static void arrive_and_wait(ThreadCtx& c, Barrier& b, Check&& check) {
  LaunchState* st = c.st;
  if (st->failed.load()) throw Abort{};
  if (!st->os_threads) {
    if (++b.count == b.expected) {
      b.count = 0;
      ++b.gen;
      const std::string err = check();
      if (!err.empty()) fail(err);
      return;
    }
    Fiber* f = c.fiber;
    f->wait = &b;
    f->wait_gen = b.gen;
    f->worker->block(f);
    f->wait = nullptr;
    if (st->failed.load()) throw Abort{};
    return;
  }
  std::unique_lock<std::mutex> lk(b.mu);
  if (++b.count == b.expected) {
    const std::string err = check();  // the others still wait: their tags are stable
    if (!err.empty()) {
      lk.unlock();
      fail(err);
    }
    b.count = 0;
    ++b.gen;
    b.cv.notify_all();
    return;
  }
  const unsigned long g = b.gen;
  const auto timeout = std::chrono::duration<double>(config().timeout_s);
  if (!b.cv.wait_for(lk, timeout, [&] { return b.gen != g || st->failed.load(); })) {
    lk.unlock();
    fail("deadlock: a barrier waited longer than the timeout (a barrier or SIMD-group operation not "
         "reached by every thread)");
  }
  if (st->failed.load()) throw Abort{};
}

unsigned char* simd_mailbox(ThreadCtx& c) { return &c.sg->slot[c.simd_seq & 1][0][0]; }

static const char* op_name(int op) {
  switch (op) {
    case kOpBarrier: return "simdgroup_barrier";
    case kOpShuffle: return "simd_shuffle*";
    case kOpReduce: return "simd reduction";
    case kOpVote: return "simd vote";
    case kOpMatLoad: return "simdgroup_load";
    case kOpMatStore: return "simdgroup_store";
    case kOpMatMul: return "simdgroup_multiply*";
  }
  return "?";
}

void simd_sync(ThreadCtx& c, int op) {
  SimdShared& s = *c.sg;
  s.tag[c.lane] = (c.simd_seq << 8) | unsigned(op);
  ++c.simd_seq;
  arrive_and_wait(c, s.bar, [&]() -> std::string {
    for (int l = 1; l < 32; ++l)
      if (s.tag[l] != s.tag[0]) {
        return cat("divergent SIMD-group operations: lane 0 is at ", op_name(int(s.tag[0] & 0xff)), " #",
                   s.tag[0] >> 8, ", lane ", l, " at ", op_name(int(s.tag[l] & 0xff)), " #", s.tag[l] >> 8);
      }
    return std::string();
  });
}

void tg_barrier(ThreadCtx& c) {
  GroupShared& g = *c.group;
  g.tg_tag[c.tid] = c.tg_seq++;
  arrive_and_wait(c, g.bar, [&]() -> std::string {
    for (size_t t = 1; t < g.tg_tag.size(); ++t)
      if (g.tg_tag[t] != g.tg_tag[0]) return "threads of the threadgroup are at different threadgroup_barriers";
    return std::string();
  });
}

unsigned attr(int which, int comp) {
  ThreadCtx& c = *current();
  const Launch& L = *c.st->launch;
  const long tpos[3] = {long(c.tid) % L.threads[0], (long(c.tid) / L.threads[0]) % L.threads[1],
                        long(c.tid) / (L.threads[0] * L.threads[1])};
  switch (which) {
    case kThreadPositionInGrid: return unsigned(c.group->pos[comp] * L.threads[comp] + tpos[comp]);
    case kThreadgroupPositionInGrid: return unsigned(c.group->pos[comp]);
    case kThreadPositionInThreadgroup: return unsigned(tpos[comp]);
    case kThreadIndexInThreadgroup: return c.tid;
    case kThreadsPerThreadgroup: return unsigned(L.threads[comp]);
    case kThreadgroupsPerGrid: return unsigned(L.grid[comp]);
    case kSimdgroupIndexInThreadgroup: return c.sgid;
    case kThreadIndexInSimdgroup: return c.lane;
    case kThreadsPerSimdgroup: return 32u;
    case kSimdgroupsPerThreadgroup: return unsigned(c.group->nsimd);
  }
  fail("unknown attribute");
}

const void* buffer_binding(int index, size_t* bytes, bool* is_bytes) {
  ThreadCtx& c = *current();
  if (index < 0 || index >= kMaxBuffers) fail("buffer index out of range");
  const Binding& b = c.st->launch->buffers[index];
  if (!b.set) fail("the shader reads [[buffer(" + std::to_string(index) + ")]], which the host did not bind");
  *bytes = b.bytes;
  *is_bytes = b.is_bytes;
  return b.ptr;
}

void* threadgroup_binding(int index) {
  ThreadCtx& c = *current();
  if (index != 0) fail("only [[threadgroup(0)]] is emulated");
  if (c.group->smem_bytes == 0)
    fail("the shader takes [[threadgroup(0)]] memory but the host set no threadgroup memory length");
  return c.group->smem.data();
}

// ===========================================================================
// Launch
// ===========================================================================
static void init_group(GroupShared& g, LaunchState& st, long index) {
  const Launch& L = *st.launch;
  g.pos[0] = index % L.grid[0];
  g.pos[1] = (index / L.grid[0]) % L.grid[1];
  g.pos[2] = index / (L.grid[0] * L.grid[1]);
  g.smem_bytes = size_t(L.smem_bytes);
  g.smem.resize(g.smem_bytes + kGuard);
  // Fresh threadgroup memory is garbage on a GPU: fill with 0xFF (NaN floats,
  // -1 ints) so that reads before writes show up, and guard the end.
  std::memset(g.smem.data(), 0xFF, g.smem_bytes);
  std::memset(g.smem.data() + g.smem_bytes, kGuardByte, kGuard);
  const int n = int(st.threads);
  g.bar.expected = n, g.bar.count = 0;
  g.tg_tag.assign(size_t(n), 0);
  g.nsimd = n / 32;
  if (!g.simd) g.simd.reset(new SimdShared[size_t(g.nsimd)]);
  for (int s = 0; s < g.nsimd; ++s) {
    g.simd[size_t(s)].bar.expected = 32;
    g.simd[size_t(s)].bar.count = 0;
  }
}

static void check_guard(GroupShared& g, LaunchState& st) {
  for (size_t i = 0; i < kGuard; ++i)
    if (g.smem[g.smem_bytes + i] != kGuardByte) {
      set_failed(&st, cat("threadgroup memory overflow: a write past the ", g.smem_bytes,
                          " bytes the host set (threadgroup ", g.pos[0], ",", g.pos[1], ",", g.pos[2], ")"));
      return;
    }
}

static void run_fibers(LaunchState& st, long groups, bool native) {
  int workers = config().workers > 0 ? config().workers : int(std::thread::hardware_concurrency());
  workers = int(std::max<long>(1, std::min<long>(workers, groups)));
  std::atomic<long> next{0};
  auto body = [&]() {
    Worker w;
    w.st = &st;
    w.native = native;
    GroupShared g;
    try {
      for (;;) {
        const long i = next.fetch_add(1);
        if (i >= groups || st.failed.load()) break;
        init_group(g, st, i);
        w.run_group(g, i);
        if (!st.failed.load()) check_guard(g, st);
      }
    } catch (const std::exception& e) {
      set_failed(&st, e.what());
    }
  };
  if (workers == 1) {
    body();
  } else {
    std::vector<std::thread> ts;
    for (int i = 0; i < workers; ++i) ts.emplace_back(body);
    for (auto& t : ts) t.join();
  }
}

// One OS thread per SIMT thread; the threadgroups run one after another.
static void run_threads(LaunchState& st, long groups) {
  const int n = int(st.threads);
  GroupShared g;
  init_group(g, st, 0);
  Barrier step;  // between threadgroups (not visible to the kernel)
  step.expected = n;
  st.all_barriers.push_back(&g.bar);
  st.all_barriers.push_back(&step);
  for (int s = 0; s < g.nsimd; ++s) st.all_barriers.push_back(&g.simd[size_t(s)].bar);
  auto body = [&](int t) {
    ThreadCtx c;
    c.st = &st, c.group = &g, c.fiber = nullptr;
    c.tid = unsigned(t), c.lane = unsigned(t % 32), c.sgid = unsigned(t / 32);
    c.sg = &g.simd[size_t(t / 32)];
    tls_ctx = &c;
    try {
      for (long i = 0; i < groups; ++i) {
        c.simd_seq = 0, c.tg_seq = 0;
        st.kernel();
        arrive_and_wait(c, step, [] { return std::string(); });
        if (t == 0) {
          check_guard(g, st);
          if (i + 1 < groups) init_group(g, st, i + 1);
        }
        arrive_and_wait(c, step, [] { return std::string(); });
      }
    } catch (const Abort&) {
    } catch (const std::exception& e) {
      set_failed(&st, std::string("exception in kernel: ") + e.what());
    }
    tls_ctx = nullptr;
  };
  std::vector<std::thread> ts;
  ts.reserve(size_t(n));
  for (int t = 0; t < n; ++t) ts.emplace_back(body, t);
  for (auto& th : ts) th.join();
}

void run(const Launch& L) {
  void (*fn)() = nullptr;
  {
    std::lock_guard<std::mutex> g(registry().mu);
    auto it = registry().kernels.find(L.kernel);
    if (it == registry().kernels.end())
      throw std::runtime_error("emu: no kernel named '" + L.kernel + "' in the shader library");
    fn = it->second;
    registry().counts[L.kernel] += 1;
  }
  const long threads = L.threads[0] * L.threads[1] * L.threads[2];
  if (threads <= 0 || threads > 1024)
    throw std::runtime_error("emu: threads per threadgroup must be in [1, 1024]");
  if (threads % 32 != 0)
    throw std::runtime_error("emu: threads per threadgroup must be a multiple of the SIMD width (32)");
  if (L.smem_bytes < 0 || L.smem_bytes > 32768)
    throw std::runtime_error("emu: threadgroup memory must be at most 32 KiB (Apple GPUs)");
  if (L.smem_bytes % 16 != 0)
    throw std::runtime_error("emu: setThreadgroupMemoryLength needs a multiple of 16 bytes");
  for (int k = 0; k < 3; ++k)
    if (L.grid[k] <= 0) throw std::runtime_error("emu: empty grid");
  const long groups = L.grid[0] * L.grid[1] * L.grid[2];

  LaunchState st;
  st.launch = &L;
  st.kernel = fn;
  st.threads = threads;
  const int mode = config().mode;
  st.os_threads = mode == kThreads;
  if (mode == kThreads) {
    run_threads(st, groups);
  } else {
    bool native = mode == kFibers && EMU_NATIVE_SWITCH;
    if (!native && !EMU_HAVE_UCONTEXT) {
      st.os_threads = true;
      run_threads(st, groups);
    } else {
      run_fibers(st, groups, native);
    }
  }
  if (st.failed.load()) throw std::runtime_error("metal emulator: " + L.kernel + ": " + st.error);
}

}  // namespace emu
