#include <cuda.h>
#include <immintrin.h>
#include <sched.h>
#include <atomic>
#include <thread>
#include <vector>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#define CK(x) do { CUresult r = (x); if (r) { printf("err %d at %s\n", r, #x); exit(1);} } while(0)
using clk = std::chrono::steady_clock;
static double now_us() { return std::chrono::duration<double, std::micro>(clk::now().time_since_epoch()).count(); }
std::atomic<int> mode{0}; std::atomic<bool> quit{false}; std::atomic<int> flag{0};
int main() {
  const size_t B = 8 << 20;
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUstream st; CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  CUdeviceptr d; CK(cuMemAlloc(&d, B)); char* pin; CK(cuMemHostAlloc((void**)&pin, B, CU_MEMHOSTALLOC_PORTABLE));
  CUevent ev[16]; for (auto& e : ev) CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
  std::vector<std::thread> th;
  for (int i = 0; i < 11; i++) th.emplace_back([] { while (!quit) { int m = mode.load(std::memory_order_relaxed); if (m == 1) _mm_pause(); else if (m == 2) sched_yield(); else if (m == 3) { for (int k = 0; k < 64; k++) { if (flag.load(std::memory_order_acquire)) break; _mm_pause(); } sched_yield(); } else std::this_thread::sleep_for(std::chrono::microseconds(200)); } });
  const char* names[] = {"spinners asleep", "11 threads pause-spinning", "11 threads sched_yield looping", "11 threads spin 64 then yield"};
  for (int round = 0; round < 2; round++)
  for (int m = 0; m < 4; m++) {
    mode = m; std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (int piece : {0, 1}) {
      std::vector<double> t, first;
      for (int r = 0; r < 101; r++) {
        double a = now_us();
        if (piece) { for (int k = 0; k < 16; k++) { CK(cuMemcpyDtoHAsync(pin + k * (B/16), d + k * (B/16), B/16, st)); CK(cuEventRecord(ev[k], st)); } CK(cuEventSynchronize(ev[0])); first.push_back(now_us() - a); CK(cuEventSynchronize(ev[15])); }
        else { CK(cuMemcpyDtoHAsync(pin, d, B, st)); CK(cuEventRecord(ev[0], st)); CK(cuEventSynchronize(ev[0])); }
        t.push_back(now_us() - a);
      }
      std::sort(t.begin(), t.end()); std::sort(first.begin(), first.end());
      printf("round %d %-34s 8MiB DtoH %s: median %.1f us%s", round, names[m], piece ? "16 x 512K + events" : "one copy", t[50], piece ? "" : "\n");
      if (piece) printf(", first 512K done at %.1f us\n", first[50]);
    }
  }
  quit = true; for (auto& x : th) x.join();
}
