// The emulated device's allocator: the CPU allocator, counting what a device allocator counts.
//
// Installed once per process in front of c10's CPU allocator (c10::SetCPUAllocator). Every
// CPU allocation is tagged, in a 64-byte header before the data, with the device slot that
// was current when it was made (0 = not on any device: the test harness, the data set) or
// with the host mark (made inside a host scope: the offload pool). Its deleter gives the
// bytes back to the slot they were taken from, whenever and on whatever thread it runs, so
// the figure is live storage bytes, exactly as `torch.cuda.memory_allocated` counts live
// blocks (without the CUDA allocator's 512-byte rounding).
//
// The current slot is process-wide, not thread-local, on purpose: gloo's worker threads
// and autograd's threads allocate on behalf of the step too. The host scope is
// thread-local: it marks one thread's copies into host memory.
//
// A slot with a limit and enforcement on throws c10::OutOfMemoryError from the allocation
// that would take it past the limit (Python sees torch.OutOfMemoryError, the type a CUDA
// allocator raises), in forward, backward or the optimizer step alike, at once, as CUDA's
// does: nothing is ever let past the limit (an expert-parallel group recovers from a
// rank's refusal by the protocol in spikeguard/parallel/exchange_journal.py, not by a
// device that waits). The check and the count are one compare-and-swap, so two threads
// allocating together can never both pass.
//
// Exposed as a C ABI for ctypes (spikeguard/memory/device.py builds and loads it): no
// pybind11, so it compiles in seconds against c10's headers alone.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

namespace {

constexpr size_t kHeader = 64;  // keeps c10's 64-byte alignment of the data
constexpr int kSlots = 4096;    // device slots (slot 0: no device); BSS, touched when used
constexpr int kWheres = 4096;   // positions in the step (set by the guard) with a peak each
constexpr uint32_t kHost = 0xffffffffu;

struct Header {
  uint64_t nbytes;
  uint32_t slot;
};

struct Slot {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> limit{0};       // 0: none
  std::atomic<int> enforce{0};
  std::atomic<int64_t> oom_request{0};  // the refused allocation and what it would have made
  std::atomic<int64_t> oom_after{0};
  std::atomic<int> peak_where{0};
  std::atomic<int64_t> where_peak[kWheres];
};

Slot g_slots[kSlots];
std::atomic<int64_t> g_host{0};
std::atomic<uint32_t> g_current{0};
std::atomic<int> g_where{0};
thread_local int t_host_depth = 0;

void raise_peak(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

void take(uint32_t slot, int64_t n) {
  Slot& s = g_slots[slot];
  int64_t before = s.allocated.load(std::memory_order_relaxed);
  int64_t after = before + n;
  for (;;) {
    after = before + n;
    int64_t limit = s.limit.load(std::memory_order_relaxed);
    if (n > 0 && limit > 0 && after > limit && s.enforce.load(std::memory_order_relaxed)) {
      s.oom_request.store(n);
      s.oom_after.store(after);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "spikeguard emulated device: allocating ", n,
                       " bytes would put ", after, " bytes on a device of ", limit, " bytes");
    }
    if (s.allocated.compare_exchange_weak(before, after, std::memory_order_relaxed)) break;
  }
  int64_t seen = s.peak.load(std::memory_order_relaxed);
  if (after > seen) {
    raise_peak(s.peak, after);
    s.peak_where.store(g_where.load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
  int where = g_where.load(std::memory_order_relaxed);
  raise_peak(s.where_peak[where], after);
}

void give_back(void* data) {
  auto* h = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
  if (h->slot == kHost) {
    g_host.fetch_sub(static_cast<int64_t>(h->nbytes), std::memory_order_relaxed);
  } else if (h->slot != 0) {
    g_slots[h->slot].allocated.fetch_sub(static_cast<int64_t>(h->nbytes),
                                         std::memory_order_relaxed);
  }
  c10::free_cpu(h);
}

struct DeviceAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    uint32_t slot = t_host_depth > 0 ? kHost : g_current.load(std::memory_order_relaxed);
    if (slot == kHost) {
      g_host.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed);
    } else if (slot != 0) {
      take(slot, static_cast<int64_t>(n));
    }
    void* base = c10::alloc_cpu(n + kHeader);
    auto* h = static_cast<Header*>(base);
    h->nbytes = n;
    h->slot = slot;
    void* data = static_cast<char*>(base) + kHeader;
    return {data, data, &give_back, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &give_back; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

DeviceAllocator g_allocator;
bool g_installed = false;

bool valid(int slot) { return slot > 0 && slot < kSlots; }

}  // namespace

extern "C" {

// Priority 1: above c10's default CPU allocator (registered at 0), so it stays in front.
int sg_install() {
  if (!g_installed) {
    c10::SetCPUAllocator(&g_allocator, 1);
    g_installed = true;
  }
  return c10::GetCPUAllocator() == &g_allocator ? 1 : 0;
}

int sg_num_slots() { return kSlots; }
int sg_num_wheres() { return kWheres; }

uint32_t sg_set_current(uint32_t slot) { return g_current.exchange(slot); }
uint32_t sg_current() { return g_current.load(); }
void sg_enter_host() { ++t_host_depth; }
void sg_exit_host() { --t_host_depth; }
int64_t sg_host_allocated() { return g_host.load(); }

int sg_where() { return g_where.load(); }

int sg_set_where(int where) {
  if (where < 0 || where >= kWheres) return -1;
  return g_where.exchange(where);
}

int64_t sg_allocated(int slot) { return valid(slot) ? g_slots[slot].allocated.load() : 0; }
int64_t sg_peak(int slot) { return valid(slot) ? g_slots[slot].peak.load() : 0; }
int sg_peak_where(int slot) { return valid(slot) ? g_slots[slot].peak_where.load() : 0; }
int64_t sg_where_peak(int slot, int where) {
  return valid(slot) && where >= 0 && where < kWheres ? g_slots[slot].where_peak[where].load() : 0;
}

void sg_reset_peak(int slot) {
  if (!valid(slot)) return;
  Slot& s = g_slots[slot];
  int64_t now = s.allocated.load();
  s.peak.store(now);
  s.peak_where.store(g_where.load());
  for (auto& w : s.where_peak) w.store(0);
}

void sg_configure(int slot, int64_t limit, int enforce) {
  if (!valid(slot)) return;
  g_slots[slot].limit.store(limit);
  g_slots[slot].enforce.store(enforce);
}

int64_t sg_oom_request(int slot) { return valid(slot) ? g_slots[slot].oom_request.load() : 0; }
int64_t sg_oom_after(int slot) { return valid(slot) ? g_slots[slot].oom_after.load() : 0; }

// Slot bookkeeping for a fresh device: its figures start from nothing it does not hold.
void sg_clear(int slot) {
  if (!valid(slot)) return;
  Slot& s = g_slots[slot];
  s.peak.store(s.allocated.load());
  s.limit.store(0);
  s.enforce.store(0);
  for (auto& w : s.where_peak) w.store(0);
}

}  // extern "C"
