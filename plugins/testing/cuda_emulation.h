// The CUDA built-ins the device code (kernel headers such as kernels/topk_device.cuh, the sections the older tests cut
// out of .cu files, and the shared __host__ __device__ flows) uses, for running it on the CPU with g++: every CUDA
// thread of a block is a fiber (a user-space context with its own stack), __syncthreads() a barrier over the block's
// fibers, blockIdx set by the driver loop before it starts a block. Warp intrinsics exchange through a per-warp barrier
// of 32 fibers (the device code calls them with full warps only, as the kernels do). emulateLaunch runs a grid's blocks
// one after another. Included first by every *_emulation.cpp (one program each), so the macros are set before any
// criticalkv header.
//
// Why fibers and not one std::thread per CUDA thread (the first form): the device code meets at a barrier every few
// instructions (every warp-level instruction is a meeting of 32 lanes), and 256 OS threads on two cores paid a futex
// and a kernel context switch at each: a d_h 128 / hidden 4096 layer took minutes. A fiber switch here is a few
// register moves (x86-64; ucontext elsewhere). The scheduler resumes every runnable fiber in turn, each running until
// it waits at a barrier or ends, alternating the order (ascending, then descending thread index) from one round to the
// next, so a read of another thread's write without a barrier between them sees the stale value in one of the two
// orders; a round with no runnable fiber is a deadlock (a barrier some threads never reach) and aborts.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include <sys/mman.h>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

struct ThreadIndex
{
    unsigned x, y, z;
};
// The running fiber's indices (the scheduler sets them before resuming a fiber: one OS thread runs them all).
inline ThreadIndex threadIdx, blockIdx;
inline ThreadIndex gridDim{1, 1, 1}, blockDim{1, 1, 1};

namespace ckvemu
{

#if defined(__x86_64__)
// ckv_emu_switch(save, load): store the callee-saved registers, MXCSR and the x87 control word on the current stack,
// its stack pointer into *save, then resume the context whose stack pointer is `load`.
extern "C" void ckv_emu_switch(void** save, void* load);
asm(".text\n"
    ".weak ckv_emu_switch\n"
    ".type ckv_emu_switch,@function\n"
    "ckv_emu_switch:\n"
    "    pushq %rbp\n"
    "    pushq %rbx\n"
    "    pushq %r12\n"
    "    pushq %r13\n"
    "    pushq %r14\n"
    "    pushq %r15\n"
    "    subq $8, %rsp\n"
    "    stmxcsr (%rsp)\n"
    "    fnstcw 4(%rsp)\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    ldmxcsr (%rsp)\n"
    "    fldcw 4(%rsp)\n"
    "    addq $8, %rsp\n"
    "    popq %r15\n"
    "    popq %r14\n"
    "    popq %r13\n"
    "    popq %r12\n"
    "    popq %rbx\n"
    "    popq %rbp\n"
    "    ret\n"
    ".size ckv_emu_switch, .-ckv_emu_switch\n");
#endif

struct Barrier;

struct Fiber
{
#if defined(__x86_64__)
    void* sp = nullptr;
#else
    ucontext_t context;
#endif
    unsigned char* stack = nullptr;
    bool done = false;
    Barrier* waitOn = nullptr;    //!< the barrier this fiber waits at, or nullptr
    uint64_t waitGeneration = 0;  //!< the barrier's generation when it arrived: runnable once it moved on
};

constexpr size_t kFiberStack = 256 * 1024;

//! The fibers of the running block and the scheduler's own context.
struct Scheduler
{
    std::vector<Fiber> fibers;
    unsigned current = 0;
    unsigned threads = 0;
    std::function<void(unsigned)> body;     //!< fn of fiber i
    std::function<void(unsigned)> activate; //!< per-thread state of fiber i, set before every resume
#if defined(__x86_64__)
    void* mainSp = nullptr;
#else
    ucontext_t mainContext;
#endif

    ~Scheduler()
    {
        for (Fiber& f : fibers)
        {
            if (f.stack != nullptr)
            {
                munmap(f.stack, kFiberStack);
            }
        }
    }
};

inline Scheduler& scheduler()
{
    static Scheduler s;
    return s;
}

//! Back to the scheduler (from a fiber).
inline void yieldToScheduler()
{
    Scheduler& s = scheduler();
    Fiber& f = s.fibers[s.current];
#if defined(__x86_64__)
    ckv_emu_switch(&f.sp, s.mainSp);
#else
    swapcontext(&f.context, &s.mainContext);
#endif
}

//! A barrier of `expected` fibers (std::barrier's arrive_and_wait). The last to arrive runs `completion` (if any)
//! before the others resume.
struct Barrier
{
    std::ptrdiff_t expected;
    std::ptrdiff_t arrived = 0;
    uint64_t generation = 0;

    explicit Barrier(std::ptrdiff_t count = 32) : expected(count) {}
    Barrier(Barrier const&) = delete;
    Barrier& operator=(Barrier const&) = delete;

    template <typename Completion>
    void arrive_and_wait(Completion&& completion)
    {
        if (++arrived == expected)
        {
            completion();
            arrived = 0;
            ++generation;
            return;
        }
        Scheduler& s = scheduler();
        Fiber& f = s.fibers[s.current];
        f.waitOn = this;
        f.waitGeneration = generation;
        yieldToScheduler();
    }

    void arrive_and_wait()
    {
        arrive_and_wait([] {});
    }
};

[[noreturn]] inline void fiberStart()
{
    Scheduler& s = scheduler();
    unsigned const index = s.current;
    s.body(index);
    s.fibers[index].done = true;
    yieldToScheduler();
    std::abort(); // a finished fiber is never resumed
}

#if !defined(__x86_64__)
inline void fiberStartC()
{
    fiberStart();
}
#endif

//! Run body(i) for fibers i = 0 .. threads - 1 until every one has returned; activate(i) before each resume.
inline void runFibers(unsigned threads, std::function<void(unsigned)> body, std::function<void(unsigned)> activate)
{
    Scheduler& s = scheduler();
    if (s.fibers.size() < threads)
    {
        s.fibers.resize(threads);
    }
    s.threads = threads;
    s.body = std::move(body);
    s.activate = std::move(activate);
    for (unsigned i = 0; i < threads; ++i)
    {
        Fiber& f = s.fibers[i];
        if (f.stack == nullptr)
        {
            void* stack = mmap(nullptr, kFiberStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                -1, 0);
            if (stack == MAP_FAILED)
            {
                std::fprintf(stderr, "emulation: no memory for a fiber stack\n");
                std::abort();
            }
            f.stack = static_cast<unsigned char*>(stack);
        }
        f.done = false;
        f.waitOn = nullptr;
#if defined(__x86_64__)
        // the stack ckv_emu_switch expects: control words, r15 .. rbp, the address it returns to (fiberStart) and a
        // fake return address of fiberStart, so that fiberStart starts with the stack alignment of a called function
        auto* top = reinterpret_cast<uint64_t*>(f.stack + kFiberStack);
        top[-1] = 0;
        top[-2] = reinterpret_cast<uint64_t>(&fiberStart);
        for (int r = 3; r <= 8; ++r)
        {
            top[-r] = 0;
        }
        top[-9] = 0x1F80ull | (0x037Full << 32); // MXCSR default, x87 control word default
        f.sp = &top[-9];
#else
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack;
        f.context.uc_stack.ss_size = kFiberStack;
        f.context.uc_link = nullptr;
        makecontext(&f.context, fiberStartC, 0);
#endif
    }
    unsigned remaining = threads;
    bool forward = true;
    while (remaining > 0)
    {
        bool resumed = false;
        for (unsigned j = 0; j < threads; ++j)
        {
            unsigned const i = forward ? j : threads - 1 - j;
            Fiber& f = s.fibers[i];
            if (f.done || (f.waitOn != nullptr && f.waitOn->generation == f.waitGeneration))
            {
                continue;
            }
            f.waitOn = nullptr;
            s.current = i;
            threadIdx = ThreadIndex{i, 0, 0};
            if (s.activate)
            {
                s.activate(i);
            }
#if defined(__x86_64__)
            ckv_emu_switch(&s.mainSp, f.sp);
#else
            swapcontext(&s.mainContext, &f.context);
#endif
            resumed = true;
            remaining -= f.done ? 1 : 0;
        }
        if (!resumed)
        {
            std::fprintf(stderr, "emulation: deadlock in block (%u, %u, %u): %u of %u threads wait at a barrier the "
                                 "others never reach\n",
                blockIdx.x, blockIdx.y, blockIdx.z, remaining, threads);
            std::abort();
        }
        forward = !forward;
    }
}

} // namespace ckvemu

using EmulatedBarrier = ckvemu::Barrier;
inline EmulatedBarrier* gBarrier = nullptr;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__
#define __restrict__
#define __syncthreads() gBarrier->arrive_and_wait()
#define __threadfence() std::atomic_thread_fence(std::memory_order_seq_cst)

struct float2
{
    float x, y;
};

struct uint4
{
    uint32_t x, y, z, w;
};

inline float2 make_float2(float x, float y)
{
    return float2{x, y};
}

template <typename T>
T atomicAdd(T* address, T value)
{
    return std::atomic_ref<T>(*address).fetch_add(value);
}

template <typename T>
T atomicMax(T* address, T value)
{
    std::atomic_ref<T> ref(*address);
    T old = ref.load();
    while (old < value && !ref.compare_exchange_weak(old, value))
    {
    }
    return old;
}

//! One warp's exchange slots: every lane posts its value, the last lane to arrive at the warp's barrier publishes
//! them all, every lane reads. One meeting per exchange: a lane's next post goes to `slots`, which nobody reads, and
//! `published` changes only once every lane has arrived again (so has read it).
struct EmulatedWarp
{
    EmulatedBarrier barrier{32};
    uint64_t slots[32] = {};
    uint64_t published[32] = {};
};
inline EmulatedWarp* tWarp = nullptr; // the running fiber's warp

inline unsigned emulatedLane()
{
    return threadIdx.x % 32u;
}

//! Every lane's `value` (as 64 bits) after a full-warp exchange.
template <typename T>
void warpExchange(T value, uint64_t (&out)[32])
{
    static_assert(sizeof(T) <= sizeof(uint64_t), "warp exchange of at most 64 bits");
    uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    EmulatedWarp* const warp = tWarp;
    warp->slots[emulatedLane()] = bits;
    warp->barrier.arrive_and_wait([warp] { std::memcpy(warp->published, warp->slots, sizeof(warp->slots)); });
    std::memcpy(out, warp->published, sizeof(out));
}

template <typename T>
T warpSlot(uint64_t const (&all)[32], unsigned lane)
{
    T value;
    std::memcpy(&value, &all[lane], sizeof(T));
    return value;
}

inline void __syncwarp(unsigned = 0xffffffffu)
{
    tWarp->barrier.arrive_and_wait();
}

inline unsigned __ballot_sync(unsigned, int predicate)
{
    uint64_t all[32];
    warpExchange<int>(predicate != 0 ? 1 : 0, all);
    unsigned mask = 0;
    for (unsigned lane = 0; lane < 32; ++lane)
    {
        mask |= warpSlot<int>(all, lane) ? (1u << lane) : 0u;
    }
    return mask;
}

inline int __any_sync(unsigned mask, int predicate)
{
    return __ballot_sync(mask, predicate) != 0;
}

inline int __all_sync(unsigned mask, int predicate)
{
    return __ballot_sync(mask, predicate) == 0xffffffffu;
}

template <typename T>
T __shfl_sync(unsigned, T value, int source)
{
    uint64_t all[32];
    warpExchange(value, all);
    return warpSlot<T>(all, static_cast<unsigned>(source) % 32u);
}

template <typename T>
T __shfl_up_sync(unsigned, T value, unsigned delta)
{
    uint64_t all[32];
    warpExchange(value, all);
    unsigned const lane = emulatedLane();
    return lane >= delta ? warpSlot<T>(all, lane - delta) : value;
}

template <typename T>
T __shfl_down_sync(unsigned, T value, unsigned delta)
{
    uint64_t all[32];
    warpExchange(value, all);
    unsigned const lane = emulatedLane();
    return lane + delta < 32u ? warpSlot<T>(all, lane + delta) : value;
}

template <typename T>
T __shfl_xor_sync(unsigned, T value, int laneMask)
{
    uint64_t all[32];
    warpExchange(value, all);
    return warpSlot<T>(all, emulatedLane() ^ static_cast<unsigned>(laneMask));
}

template <typename T>
unsigned __match_any_sync(unsigned, T value)
{
    uint64_t all[32];
    warpExchange(value, all);
    T const mine = warpSlot<T>(all, emulatedLane());
    unsigned mask = 0;
    for (unsigned lane = 0; lane < 32; ++lane)
    {
        mask |= warpSlot<T>(all, lane) == mine ? (1u << lane) : 0u;
    }
    return mask;
}

inline int __popc(unsigned x)
{
    return __builtin_popcount(x);
}

inline int __popcll(unsigned long long x)
{
    return __builtin_popcountll(x);
}

inline int __ffs(int x)
{
    return __builtin_ffs(x);
}

inline unsigned __float_as_uint(float x)
{
    unsigned bits;
    std::memcpy(&bits, &x, sizeof(bits));
    return bits;
}

//! Run one block (x, y, z) of `threads` fibers (1-D, a multiple of 32) meeting at one barrier, each warp at its own;
//! activate(t) sets further per-thread state (mma_emulation.h's) before every resume of thread t.
template <typename Fn>
void runBlockFibers(unsigned x, unsigned y, unsigned z, unsigned threads, Fn fn,
    std::function<void(unsigned)> activate = {})
{
    blockDim = ThreadIndex{threads, 1, 1};
    blockIdx = ThreadIndex{x, y, z};
    EmulatedBarrier barrier(static_cast<std::ptrdiff_t>(threads));
    EmulatedBarrier* const previous = gBarrier;
    gBarrier = &barrier;
    std::vector<std::unique_ptr<EmulatedWarp>> warps;
    for (unsigned w = 0; w < (threads + 31) / 32; ++w)
    {
        warps.push_back(std::make_unique<EmulatedWarp>());
    }
    ckvemu::runFibers(
        threads, [&](unsigned) { fn(); },
        [&](unsigned t) {
            tWarp = warps[t / 32].get();
            if (activate)
            {
                activate(t);
            }
        });
    gBarrier = previous;
}

//! Run fn() as a grid of (grid.x, grid.y, grid.z) blocks of `threads` threads (1-D blocks, a multiple of 32):
//! blocks one after the other (runBlockFibers).
template <typename Fn>
void emulateLaunch(ThreadIndex grid, unsigned threads, Fn fn)
{
    gridDim = grid;
    for (unsigned z = 0; z < grid.z; ++z)
    {
        for (unsigned y = 0; y < grid.y; ++y)
        {
            for (unsigned x = 0; x < grid.x; ++x)
            {
                runBlockFibers(x, y, z, threads, fn);
            }
        }
    }
}

//! A load past the L1 cache: a plain load here (blocks run one after another).
template <typename T>
T __ldcg(T const* address)
{
    return *address;
}
