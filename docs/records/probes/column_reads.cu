// Column reads from the page cache: what a rank's column slice costs when each run of a row is
// read on its own (pread), and when the runs are handed to the kernel in batches (Linux AIO,
// io_uring) or copied out of a mapping, beside the whole file read in 16 MiB pieces.
//
//   nvcc -O2 -std=c++17 -o column_reads column_reads.cu -lcuda -Xcompiler -pthread
//   ./column_reads [FILE] [GiB]
//
// The file (default /tmp/column_reads.bin, 2 GiB) is written once and read whole before the
// timings, so every read is served from the page cache. A "row" is 16 KiB (an [N, 8192] bf16
// tensor); a rank of a world of 8 takes 2 KiB of each. Destinations are page-locked
// (cuMemHostAlloc), as the loader's staging slots are. Build with -DNO_CUDA to use plain memory.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <functional>
#include <linux/aio_abi.h>
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <thread>
#include <unistd.h>
#include <vector>
#ifndef NO_CUDA
#include <cuda.h>
#endif

static const size_t ROW = 16384;
static const size_t SLOT = 16 << 20;  // each thread's destination, reused in turn (a staging slot)

static void *pinned(size_t n) {
#ifndef NO_CUDA
    void *p = nullptr;
    if (cuMemHostAlloc(&p, n, 0) != CUDA_SUCCESS) {
        fprintf(stderr, "cuMemHostAlloc(%zu) failed\n", n);
        exit(1);
    }
    return p;
#else
    void *p = aligned_alloc(4096, n);
    memset(p, 0, n);
    return p;
#endif
}

static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Runs `work(t)` on `threads` threads at once; the wall time in seconds.
static double at_once(int threads, const std::function<void(int)> &work) {
    std::vector<std::thread> pool;
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    double start = 0;
    for (int t = 0; t < threads; t++)
        pool.emplace_back([&, t] {
            ready++;
            while (!go.load()) {
            }
            work(t);
        });
    while (ready.load() < threads) {
    }
    start = now();
    go = true;
    for (auto &th : pool) th.join();
    return now() - start;
}

static void full_pread(int fd, char *buf, size_t len, off_t at) {
    size_t got = 0;
    while (got < len) {
        ssize_t n = pread(fd, buf + got, len - got, at + got);
        if (n <= 0) {
            perror("pread");
            exit(1);
        }
        got += n;
    }
}

struct Case {
    size_t run, stride;  // bytes read of each row, and the row's length
};

// Best of three: the whole file, `threads` threads, each its region in 16 MiB pieces.
static double limit(int fd, size_t size, int threads, std::vector<char *> &bufs) {
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double s = at_once(threads, [&](int t) {
            size_t per = size / threads, from = t * per;
            for (size_t at = 0; at < per; at += 16 << 20)
                full_pread(fd, bufs[t], std::min<size_t>(16 << 20, per - at), from + at);
        });
        best = std::max(best, size / s / (1 << 30));
    }
    return best;
}

// Each thread reads `run` bytes of each of its rows with one pread each: through the one
// descriptor all threads share, or (`own`) through a descriptor of its own, the file opened again
// through /proc/self/fd (a struct file of its own, so no reference count or read-ahead state is
// shared between threads).
static double columns_pread(int shared, size_t size, Case c, int threads, std::vector<char *> &bufs,
                            bool own = false) {
    size_t rows = size / c.stride;
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        std::vector<int> fds(threads, shared);
        if (own)
            for (auto &f : fds) {
                char link[64];
                snprintf(link, sizeof link, "/proc/self/fd/%d", shared);
                f = open(link, O_RDONLY);
                if (f < 0) {
                    perror("reopen");
                    exit(1);
                }
            }
        double s = at_once(threads, [&](int t) {
            int fd = fds[t];
            size_t per = rows / threads;
            char *out = bufs[t];
            for (size_t r = t * per; r < (t + 1) * per; r++, out += c.run) {
                if (out + c.run > bufs[t] + SLOT) out = bufs[t];
                full_pread(fd, out, c.run, r * c.stride + c.stride - c.run);
            }
        });
        if (own)
            for (int f : fds) close(f);
        best = std::max(best, rows * c.run / s / (1 << 30));
    }
    return best;
}

// The same runs through Linux AIO: io_submit of `depth` reads, io_getevents for all of them.
static double columns_aio(int fd, size_t size, Case c, int threads, int depth,
                          std::vector<char *> &bufs) {
    size_t rows = size / c.stride;
    double best = 0;
    std::atomic<int> failed{0};
    for (int rep = 0; rep < 3; rep++) {
        double s = at_once(threads, [&](int t) {
            aio_context_t ctx = 0;
            if (syscall(SYS_io_setup, depth, &ctx) < 0) {
                failed = errno;
                return;
            }
            std::vector<iocb> cbs(depth);
            std::vector<iocb *> ptrs(depth);
            std::vector<io_event> events(depth);
            size_t per = rows / threads;
            char *out = bufs[t];
            for (size_t r = t * per; r < (t + 1) * per;) {
                int n = 0;
                for (; n < depth && r < (t + 1) * per; n++, r++, out += c.run) {
                    if (out + c.run > bufs[t] + SLOT) out = bufs[t];
                    memset(&cbs[n], 0, sizeof(iocb));
                    cbs[n].aio_lio_opcode = IOCB_CMD_PREAD;
                    cbs[n].aio_fildes = fd;
                    cbs[n].aio_buf = (uint64_t)out;
                    cbs[n].aio_nbytes = c.run;
                    cbs[n].aio_offset = r * c.stride + c.stride - c.run;
                    ptrs[n] = &cbs[n];
                }
                if (syscall(SYS_io_submit, ctx, n, ptrs.data()) != n) {
                    failed = errno;
                    break;
                }
                int got = 0;
                while (got < n) {
                    long e = syscall(SYS_io_getevents, ctx, n - got, n - got, events.data(), nullptr);
                    if (e < 0) {
                        failed = errno;
                        break;
                    }
                    for (long i = 0; i < e; i++)
                        if (events[i].res != (int64_t)c.run) failed = 1000;
                    got += e;
                }
            }
            syscall(SYS_io_destroy, ctx);
        });
        if (failed) return -failed;
        best = std::max(best, rows * c.run / s / (1 << 30));
    }
    return best;
}

// One io_uring of `depth` entries per thread, set up with raw system calls.
struct Ring {
    int fd = -1;
    unsigned *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    io_uring_sqe *sqes;
    io_uring_cqe *cqes;

    int setup(unsigned depth) {
        io_uring_params p{};
        fd = syscall(__NR_io_uring_setup, depth, &p);
        if (fd < 0) return errno;
        size_t sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
        size_t cq_len = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
        size_t len = std::max(sq_len, cq_len);
        char *sq = (char *)mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                                IORING_OFF_SQ_RING);
        char *cq = sq;
        if (!(p.features & IORING_FEAT_SINGLE_MMAP))
            cq = (char *)mmap(nullptr, cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                              IORING_OFF_CQ_RING);
        sqes = (io_uring_sqe *)mmap(nullptr, p.sq_entries * sizeof(io_uring_sqe),
                                    PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                                    IORING_OFF_SQES);
        if (sq == MAP_FAILED || cq == MAP_FAILED || sqes == MAP_FAILED) return errno;
        sq_tail = (unsigned *)(sq + p.sq_off.tail);
        sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
        sq_array = (unsigned *)(sq + p.sq_off.array);
        cq_head = (unsigned *)(cq + p.cq_off.head);
        cq_tail = (unsigned *)(cq + p.cq_off.tail);
        cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
        cqes = (io_uring_cqe *)(cq + p.cq_off.cqes);
        return 0;
    }
};

static double columns_uring(int fd, size_t size, Case c, int threads, unsigned depth,
                            std::vector<char *> &bufs) {
    size_t rows = size / c.stride;
    double best = 0;
    std::atomic<int> failed{0};
    for (int rep = 0; rep < 3; rep++) {
        double s = at_once(threads, [&](int t) {
            Ring ring;
            if (int e = ring.setup(depth)) {
                failed = e;
                return;
            }
            size_t per = rows / threads;
            char *out = bufs[t];
            for (size_t r = t * per; r < (t + 1) * per;) {
                unsigned tail = *ring.sq_tail, n = 0;
                for (; n < depth && r < (t + 1) * per; n++, r++, out += c.run) {
                    if (out + c.run > bufs[t] + SLOT) out = bufs[t];
                    unsigned i = (tail + n) & *ring.sq_mask;
                    io_uring_sqe *sqe = &ring.sqes[i];
                    memset(sqe, 0, sizeof(*sqe));
                    sqe->opcode = IORING_OP_READ;
                    sqe->fd = fd;
                    sqe->addr = (uint64_t)out;
                    sqe->len = c.run;
                    sqe->off = r * c.stride + c.stride - c.run;
                    ring.sq_array[i] = i;
                }
                __atomic_store_n(ring.sq_tail, tail + n, __ATOMIC_RELEASE);
                unsigned done = 0;
                while (done < n) {
                    long e = syscall(__NR_io_uring_enter, ring.fd, done == 0 ? n : 0, n - done,
                                     IORING_ENTER_GETEVENTS, nullptr, 0);
                    if (e < 0) {
                        failed = errno;
                        return;
                    }
                    unsigned head = *ring.cq_head, ctail = __atomic_load_n(ring.cq_tail, __ATOMIC_ACQUIRE);
                    for (; head != ctail; head++, done++)
                        if (ring.cqes[head & *ring.cq_mask].res != (int)c.run) failed = 1000;
                    __atomic_store_n(ring.cq_head, head, __ATOMIC_RELEASE);
                }
            }
            close(ring.fd);
        });
        if (failed) return -failed;
        best = std::max(best, rows * c.run / s / (1 << 30));
    }
    return best;
}

// The same runs copied out of a read-only mapping of each thread's rows (faulted on touch).
static double columns_mmap(int fd, size_t size, Case c, int threads, bool populate,
                           std::vector<char *> &bufs) {
    size_t rows = size / c.stride;
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double s = at_once(threads, [&](int t) {
            size_t per = rows / threads;
            size_t from = t * per * c.stride, len = per * c.stride;
            char *map = (char *)mmap(nullptr, len, PROT_READ,
                                     MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, from);
            if (map == MAP_FAILED) {
                perror("mmap");
                exit(1);
            }
            char *out = bufs[t];
            for (size_t r = 0; r < per; r++, out += c.run) {
                if (out + c.run > bufs[t] + SLOT) out = bufs[t];
                memcpy(out, map + r * c.stride + c.stride - c.run, c.run);
            }
            munmap(map, len);
        });
        best = std::max(best, rows * c.run / s / (1 << 30));
    }
    return best;
}

int main(int argc, char **argv) {
    const char *path = argc > 1 ? argv[1] : "/tmp/column_reads.bin";
    size_t size = (argc > 2 ? atol(argv[2]) : 2) << 30;
#ifndef NO_CUDA
    CUdevice dev;
    CUcontext ctx;
    cuInit(0);
    cuDeviceGet(&dev, 0);
    cuDevicePrimaryCtxRetain(&ctx, dev);
    cuCtxSetCurrent(ctx);
#endif
    int fd = open(path, O_RDWR | O_CREAT, 0644);
    if (fd < 0) {
        perror("open");
        return 1;
    }
    {
        std::vector<char> block(16 << 20);
        for (size_t i = 0; i < block.size(); i++) block[i] = (char)(i * 2654435761u >> 13);
        for (size_t at = 0; at < size; at += block.size()) (void)!pwrite(fd, block.data(), block.size(), at);
        std::vector<char> sink(16 << 20);
        for (size_t at = 0; at < size; at += sink.size()) full_pread(fd, sink.data(), sink.size(), at);
    }
    const int max_threads = 32;
    std::vector<char *> bufs(max_threads);
    size_t per_buf = SLOT;
    for (auto &b : bufs) b = (char *)pinned(per_buf);
    printf("file %s, %zu GiB, rows of %zu bytes, %u cores\n", path, size >> 30, ROW,
           std::thread::hardware_concurrency());
    printf("limit (16 MiB pieces, best of 3): 8 threads %.1f GiB/s, 16 threads %.1f GiB/s\n",
           limit(fd, size, 8, bufs), limit(fd, size, 16, bufs));
    printf("\nmethod, run bytes, threads, depth: GiB/s of bytes read (best of 3), us of a thread per run\n");
    auto report = [&](const char *m, Case c, int t, int d, double g) {
        size_t rows = size / c.stride;
        if (g < 0) {
            printf("%-6s %6zu %3d %4d: failed, errno %d\n", m, c.run, t, d, (int)-g);
            return;
        }
        double secs = rows * c.run / (g * (1 << 30));
        printf("%-6s %6zu %3d %4d: %6.1f GiB/s  %6.2f us\n", m, c.run, t, d, g, secs * t / rows * 1e6);
    };
    for (size_t run : {2048, 4096, 8192}) {
        Case c{run, ROW};
        for (int t : {1, 4, 8, 16, 24, 32}) report("pread", c, t, 1, columns_pread(fd, size, c, t, bufs));
    }
    for (size_t run : {2048, 4096, 8192}) {
        Case c{run, ROW};
        for (int t : {1, 4, 8, 16, 24, 32})
            report("pread*", c, t, 1, columns_pread(fd, size, c, t, bufs, true));
    }
    printf("(pread*: each thread through a descriptor of its own)\n");
    Case c{2048, ROW};
    for (int d : {32, 256})
        for (int t : {8, 16, 24}) report("aio", c, t, d, columns_aio(fd, size, c, t, d, bufs));
    for (int d : {32, 256})
        for (int t : {1, 8, 16, 24}) report("uring", c, t, d, columns_uring(fd, size, c, t, d, bufs));
    for (int t : {8, 16}) report("mmap", c, t, 0, columns_mmap(fd, size, c, t, false, bufs));
    for (int t : {8, 16}) report("mmap+p", c, t, 0, columns_mmap(fd, size, c, t, true, bufs));
    close(fd);
    unlink(path);
    return 0;
}
