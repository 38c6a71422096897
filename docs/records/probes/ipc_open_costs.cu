// Device memory shared between two processes on one GPU, on the driver API alone: what an
// import (open) and a release cost through each mechanism, and whether imported memory stays
// valid once the exporting process has exited.
//
// Two processes (fork before any CUDA call; a Unix socket pair between them, the pool's file
// descriptor sent with SCM_RIGHTS):
// - the exporter allocates 64 MiB twice: from a memory pool made exportable
//   (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; cuMemPoolExportPointer per allocation), and with
//   cuMemAlloc (legacy IPC: cuIpcGetMemHandle); and an inter-process event (cuIpcGetEventHandle);
// - the importer imports the pool once, then opens and releases each allocation 200 times:
//   cuMemPoolImportPointer / cuMemFree, and cuIpcOpenMemHandle / cuIpcCloseMemHandle, and opens
//   the event; it reports the medians;
// - then the importer opens both allocations, the exporter exits (its context torn down), and
//   the importer reads both back and checks the pattern the exporter wrote.
#include <cuda.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#define CK(x) do { CUresult r = (x); if (r) { const char* s; cuGetErrorName(r, &s); printf("%s: %s (%d) at %s\n", who, s, r, #x); exit(1);} } while(0)
static const char* who = "?";
using clk = std::chrono::steady_clock;
static double now_us() { return std::chrono::duration<double, std::micro>(clk::now().time_since_epoch()).count(); }
static double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

struct Wire {
  CUmemPoolPtrExportData pool_ptr;
  CUipcMemHandle legacy;
  CUipcEventHandle event;
};

static void send_fd(int sock, int fd, const void* data, size_t len) {
  struct msghdr msg = {};
  struct iovec iov = {const_cast<void*>(data), len};
  msg.msg_iov = &iov; msg.msg_iovlen = 1;
  char ctrl[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = ctrl; msg.msg_controllen = sizeof(ctrl);
  struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET; c->cmsg_type = SCM_RIGHTS; c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &fd, sizeof(int));
  if (sendmsg(sock, &msg, 0) != (ssize_t)len) { perror("sendmsg"); exit(1); }
}

static int recv_fd(int sock, void* data, size_t len) {
  struct msghdr msg = {};
  struct iovec iov = {data, len};
  msg.msg_iov = &iov; msg.msg_iovlen = 1;
  char ctrl[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = ctrl; msg.msg_controllen = sizeof(ctrl);
  if (recvmsg(sock, &msg, MSG_WAITALL) != (ssize_t)len) { perror("recvmsg"); exit(1); }
  int fd; memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&msg)), sizeof(int));
  return fd;
}

static CUcontext init() {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  return ctx;
}

static const size_t BYTES = 64 << 20;
static const unsigned PATTERN = 0x5eed1234u;

static int exporter(int sock) {
  who = "exporter";
  init();
  CUstream st; CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  CUmemPoolProps props = {};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE; props.location.id = 0;
  CUmemoryPool pool; CK(cuMemPoolCreate(&pool, &props));
  CUdeviceptr pooled; CK(cuMemAllocFromPoolAsync(&pooled, BYTES, pool, st));
  CUdeviceptr legacy; CK(cuMemAlloc(&legacy, BYTES));
  CK(cuMemsetD32Async(pooled, PATTERN, BYTES / 4, st));
  CK(cuMemsetD32Async(legacy, PATTERN, BYTES / 4, st));
  CUevent ev; CK(cuEventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
  CK(cuEventRecord(ev, st));
  CK(cuStreamSynchronize(st));
  // The pool is exported before any pointer from it: on driver 580 (CUDA 13.0) an export of a
  // pointer of a pool not yet exported is CUDA_ERROR_INVALID_VALUE.
  int fd; CK(cuMemPoolExportToShareableHandle(&fd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  Wire w;
  CK(cuMemPoolExportPointer(&w.pool_ptr, pooled));
  CK(cuIpcGetMemHandle(&w.legacy, legacy));
  CK(cuIpcGetEventHandle(&w.event, ev));
  send_fd(sock, fd, &w, sizeof(w));
  // Wait for the importer's word that it holds both open, then exit without freeing anything.
  char go; if (read(sock, &go, 1) != 1) { perror("read"); exit(1); }
  printf("exporter: exiting with both allocations imported\n");
  fflush(stdout);
  _exit(0);
}

static int importer(int sock, pid_t exporter_pid) {
  who = "importer";
  init();
  CUstream st; CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  Wire w;
  int fd = recv_fd(sock, &w, sizeof(w));
  double t0 = now_us();
  CUmemoryPool pool;
  CK(cuMemPoolImportFromShareableHandle(&pool, (void*)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  double pool_import = now_us() - t0;
  CUmemAccessDesc desc = {};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE; desc.location.id = 0;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUresult access = cuMemPoolSetAccess(pool, &desc, 1);
  t0 = now_us();
  CUevent ev; CK(cuIpcOpenEventHandle(&ev, w.event));
  double event_open = now_us() - t0;
  CK(cuStreamWaitEvent(st, ev, 0));
  const int N = 200;
  std::vector<double> pool_open, pool_free, pool_free_sync, ipc_open, ipc_close;
  for (int i = 0; i < N; i++) {
    CUdeviceptr p;
    double a = now_us(); CK(cuMemPoolImportPointer(&p, pool, &w.pool_ptr)); double b = now_us();
    CK(cuMemFreeAsync(p, st)); double c = now_us();
    CK(cuStreamSynchronize(st)); double d = now_us();
    pool_open.push_back(b - a); pool_free.push_back(c - b); pool_free_sync.push_back(d - b);
    CUdeviceptr q;
    a = now_us(); CK(cuIpcOpenMemHandle(&q, w.legacy, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)); b = now_us();
    CK(cuIpcCloseMemHandle(q)); c = now_us();
    ipc_open.push_back(b - a); ipc_close.push_back(c - b);
  }
  printf("importer: pool import (once) %.1f us, set access on it: %d, event open %.1f us\n", pool_import, (int)access, event_open);
  printf("importer: pool pointer  import %.1f us  free %.1f us  free+sync %.1f us (median of %d)\n",
         median(pool_open), median(pool_free), median(pool_free_sync), N);
  printf("importer: legacy IPC    open   %.1f us  close %.1f us (median of %d)\n", median(ipc_open), median(ipc_close), N);
  // Hold both open, let the exporter exit, and read both back.
  CUdeviceptr p, q;
  CK(cuMemPoolImportPointer(&p, pool, &w.pool_ptr));
  CK(cuIpcOpenMemHandle(&q, w.legacy, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  if (write(sock, "g", 1) != 1) { perror("write"); exit(1); }
  int status; waitpid(exporter_pid, &status, 0);
  usleep(200000);
  std::vector<unsigned> host(BYTES / 4);
  const char* names[2] = {"pool pointer", "legacy IPC"};
  CUdeviceptr ptrs[2] = {p, q};
  for (int k = 0; k < 2; k++) {
    std::fill(host.begin(), host.end(), 0u);
    CUresult r = cuMemcpyDtoH(host.data(), ptrs[k], BYTES);
    size_t bad = 0; for (unsigned x : host) bad += x != PATTERN;
    const char* s; cuGetErrorName(r, &s);
    printf("importer: after the exporter exited, %s read: %s, %zu of %zu words differ\n", names[k], s, bad, host.size());
  }
  CK(cuMemFree(p)); CK(cuIpcCloseMemHandle(q));
  printf("importer: released both after the exporter exited\n");
  return 0;
}

int main() {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) { perror("socketpair"); return 1; }
  pid_t pid = fork();
  if (pid == 0) { close(sv[1]); return exporter(sv[0]); }
  close(sv[0]);
  return importer(sv[1], pid);
}
