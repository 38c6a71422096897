// The 64 MiB hand-off loop on the driver API alone, three ways, to see what a step between two
// processes costs before any library is involved:
// - "processes": two processes (fork before any CUDA call, a socket pair between them). The
//   producer writes 64 MiB (cuMemsetD32Async) into memory of an exportable pool, records an
//   inter-process event and sends a byte; the consumer waits for the event on its stream, reads
//   the 64 MiB (a device copy into memory of its own), records its inter-process event and sends
//   a byte back; the producer's stream waits for that event before its next write.
// - "contexts": the same loop between two threads of one process, each with a context of its own
//   on the same GPU (what two processes are to the GPU, without the processes).
// - "streams": the same loop between two threads sharing the primary context, on two streams
//   (what two engines of one process are).
// Each runs 300 steps after 20 of warm-up and prints the time per step.
#include <cuda.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <atomic>
#include <thread>
#define CK(x) do { CUresult r = (x); if (r) { const char* s; cuGetErrorName(r, &s); printf("%s: %s (%d) at %s\n", who, s, r, #x); exit(1);} } while(0)
static const char* who = "?";
static const size_t BYTES = 64 << 20;
static const int WARM = 20, STEPS = 300;
using clk = std::chrono::steady_clock;

struct Wire { CUmemPoolPtrExportData ptr; CUipcEventHandle ev; };

static void put(int s, const void* p, size_t n) { if (write(s, p, n) != (ssize_t)n) { perror("write"); exit(1); } }
static void get(int s, void* p, size_t n) { size_t k = 0; while (k < n) { ssize_t r = read(s, (char*)p + k, n - k); if (r <= 0) { perror("read"); exit(1); } k += r; } }

static void send_fd(int sock, int fd) {
  char b = 0; struct msghdr msg = {}; struct iovec iov = {&b, 1};
  msg.msg_iov = &iov; msg.msg_iovlen = 1;
  char ctrl[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = ctrl; msg.msg_controllen = sizeof(ctrl);
  struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET; c->cmsg_type = SCM_RIGHTS; c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &fd, sizeof(int));
  if (sendmsg(sock, &msg, 0) != 1) { perror("sendmsg"); exit(1); }
}
static int recv_fd(int sock) {
  char b; struct msghdr msg = {}; struct iovec iov = {&b, 1};
  msg.msg_iov = &iov; msg.msg_iovlen = 1;
  char ctrl[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = ctrl; msg.msg_controllen = sizeof(ctrl);
  if (recvmsg(sock, &msg, 0) != 1) { perror("recvmsg"); exit(1); }
  int fd; memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&msg)), sizeof(int));
  return fd;
}

static void processes() {
  int sv[2]; socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
  pid_t pid = fork();
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUstream st; CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  CUevent mine; CK(cuEventCreate(&mine, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS));
  CUipcEventHandle mine_h; CK(cuIpcGetEventHandle(&mine_h, mine));
  if (pid == 0) {
    who = "consumer"; close(sv[0]); int s = sv[1];
    int fd = recv_fd(s); Wire w; get(s, &w, sizeof w);
    CUmemoryPool pool; CK(cuMemPoolImportFromShareableHandle(&pool, (void*)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    CUdeviceptr shared; CK(cuMemPoolImportPointer(&shared, pool, &w.ptr));
    CUevent theirs; CK(cuIpcOpenEventHandle(&theirs, w.ev));
    put(s, &mine_h, sizeof mine_h);
    CUdeviceptr own; CK(cuMemAlloc(&own, BYTES));
    for (int i = 0; i < WARM + STEPS; i++) {
      char b; get(s, &b, 1);
      CK(cuStreamWaitEvent(st, theirs, 0));
      CK(cuMemcpyDtoDAsync(own, shared, BYTES, st));
      CK(cuEventRecord(mine, st));
      put(s, &b, 1);
    }
    CK(cuStreamSynchronize(st));
    CK(cuMemFreeAsync(shared, st)); CK(cuStreamSynchronize(st));
    char b = 1; put(s, &b, 1);
    _exit(0);
  }
  who = "producer"; close(sv[1]); int s = sv[0];
  CUmemPoolProps props = {};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE; props.location.id = 0;
  CUmemoryPool pool; CK(cuMemPoolCreate(&pool, &props));
  int fd; CK(cuMemPoolExportToShareableHandle(&fd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  CUdeviceptr p; CK(cuMemAllocFromPoolAsync(&p, BYTES, pool, st)); CK(cuStreamSynchronize(st));
  Wire w; CK(cuMemPoolExportPointer(&w.ptr, p)); w.ev = mine_h;
  send_fd(s, fd); put(s, &w, sizeof w);
  CUipcEventHandle th; get(s, &th, sizeof th);
  CUevent theirs; CK(cuIpcOpenEventHandle(&theirs, th));
  clk::time_point start;
  for (int i = 0; i < WARM + STEPS; i++) {
    if (i == WARM) start = clk::now();
    CK(cuMemsetD32Async(p, (unsigned)i, BYTES / 4, st));
    CK(cuEventRecord(mine, st));
    char b = 0; put(s, &b, 1); get(s, &b, 1);
    CK(cuStreamWaitEvent(st, theirs, 0));
  }
  CK(cuStreamSynchronize(st));
  double us = std::chrono::duration<double, std::micro>(clk::now() - start).count() / STEPS;
  char b; get(s, &b, 1);
  waitpid(pid, nullptr, 0);
  printf("processes: %.1f us per step\n", us);
}

// Two threads, `separate` contexts or one, passing the turn through an atomic flag.
static void threads(bool separate) {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0));
  CUcontext primary; CK(cuDevicePrimaryCtxRetain(&primary, dev));
  CUcontext ctx[2] = {primary, primary};
  if (separate) { CK(cuCtxCreate(&ctx[0], nullptr, 0, dev)); CK(cuCtxCreate(&ctx[1], nullptr, 0, dev)); }
  CUdeviceptr buf[2]; CUstream st[2]; CUevent ev[2];
  for (int k = 0; k < 2; k++) {
    CK(cuCtxSetCurrent(ctx[k]));
    CK(cuStreamCreate(&st[k], CU_STREAM_NON_BLOCKING));
    CK(cuEventCreate(&ev[k], CU_EVENT_DISABLE_TIMING));
    CK(cuMemAlloc(&buf[k], BYTES));
  }
  // Across contexts, a device copy of the other's memory needs peer access of the same device:
  // the consumer copies its own buffer instead, so both loops move the same bytes.
  std::atomic<int> turn{0};
  double us = 0;
  std::thread consumer([&] {
    CK(cuCtxSetCurrent(ctx[1]));
    for (int i = 0; i < WARM + STEPS; i++) {
      while (turn.load() != 2 * i + 1) {}
      CK(cuStreamWaitEvent(st[1], ev[0], 0));
      CUdeviceptr scratch; CK(cuMemAllocAsync(&scratch, BYTES, st[1]));
      CK(cuMemcpyDtoDAsync(scratch, buf[1], BYTES, st[1]));
      CK(cuMemFreeAsync(scratch, st[1]));
      CK(cuEventRecord(ev[1], st[1]));
      turn.store(2 * i + 2);
    }
  });
  CK(cuCtxSetCurrent(ctx[0]));
  clk::time_point start;
  for (int i = 0; i < WARM + STEPS; i++) {
    if (i == WARM) start = clk::now();
    CK(cuMemsetD32Async(buf[0], (unsigned)i, BYTES / 4, st[0]));
    CK(cuEventRecord(ev[0], st[0]));
    turn.store(2 * i + 1);
    while (turn.load() != 2 * i + 2) {}
    CK(cuStreamWaitEvent(st[0], ev[1], 0));
  }
  CK(cuStreamSynchronize(st[0]));
  us = std::chrono::duration<double, std::micro>(clk::now() - start).count() / STEPS;
  consumer.join();
  printf("%s: %.1f us per step\n", separate ? "contexts" : "streams", us);
}

int main(int argc, char** argv) {
  const char* which = argc > 1 ? argv[1] : "all";
  if (!strcmp(which, "processes") || !strcmp(which, "all")) processes();
  if (!strcmp(which, "contexts") || !strcmp(which, "all")) threads(true);
  if (!strcmp(which, "streams") || !strcmp(which, "all")) threads(false);
  return 0;
}
