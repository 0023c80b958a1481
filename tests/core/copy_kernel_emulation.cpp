/*
 * llm_datadist/runtimes/dd_copy.cu run on the CPU, for tests/core/test_copy_kernel.py.
 *
 * The kernel source itself is #included, unchanged, after the CUDA keywords are defined away and
 * its two memory primitives, DD_COPY_LOAD and DD_COPY_STORE, are defined as checked accesses.
 * dd_emulate_launch() then runs every (block, thread) of a launch one after another. The kernel
 * uses no shared memory, barriers or atomics and no thread reads what another writes, so running
 * the threads in sequence is one of the schedules a GPU may choose; what it copies does not depend
 * on the order.
 *
 * Every access is checked: its address is a multiple of its width, a load reads only bytes marked
 * readable (the sources), a store lands inside the destination arena. Each store counts the writes
 * to every byte it covers and records its width, so the test can prove that every destination byte
 * is written exactly once, with the width the descriptor's alignment calls for.
 *
 * Built with: g++ -std=c++17 -O2 -shared -fPIC -I llm_datadist/kernels
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* ---- what nvcc would provide ---- */
struct dd_emu_dim3 {
    unsigned int x, y, z;
};
static dd_emu_dim3 threadIdx, blockIdx, blockDim, gridDim;
struct uint4 {
    unsigned int x, y, z, w;
};
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(threads)

/* ---- checked memory ---- */
static uintptr_t emu_src_base, emu_dst_base;
static size_t emu_src_len, emu_dst_len;
static const unsigned char *emu_readable; /* 1 where a source byte may be read */
static unsigned char *emu_writes;         /* writes per destination-arena byte, saturating at 255 */
static unsigned char *emu_width;          /* width of the last store covering the byte */
static unsigned long long emu_errors;
static char emu_first_error[512];

static void emu_error(const char *what, uintptr_t addr, size_t width)
{
    if (emu_errors++ == 0)
        snprintf(emu_first_error, sizeof emu_first_error, "%s: address %#lx, %zu bytes, block %u thread %u",
                 what, (unsigned long)addr, width, blockIdx.x, threadIdx.x);
}

template <typename T>
static T emu_load(const T *p)
{
    const uintptr_t addr = (uintptr_t)p;
    T value;
    memset(&value, 0, sizeof value);
    if (addr % sizeof(T)) {
        emu_error("misaligned load", addr, sizeof(T));
        return value;
    }
    if (addr < emu_src_base || addr + sizeof(T) > emu_src_base + emu_src_len) {
        emu_error("load outside the source arena", addr, sizeof(T));
        return value;
    }
    for (size_t k = 0; k < sizeof(T); ++k)
        if (!emu_readable[addr - emu_src_base + k]) {
            emu_error("load of a byte no descriptor reads", addr, sizeof(T));
            return value;
        }
    memcpy(&value, p, sizeof value);
    return value;
}

template <typename T>
static void emu_store(T *p, T value)
{
    const uintptr_t addr = (uintptr_t)p;
    if (addr % sizeof(T)) {
        emu_error("misaligned store", addr, sizeof(T));
        return;
    }
    if (addr < emu_dst_base || addr + sizeof(T) > emu_dst_base + emu_dst_len) {
        emu_error("store outside the destination arena", addr, sizeof(T));
        return;
    }
    memcpy(p, &value, sizeof value);
    for (size_t k = 0; k < sizeof(T); ++k) {
        const size_t at = addr - emu_dst_base + k;
        if (emu_writes[at] < 255)
            emu_writes[at]++;
        emu_width[at] = (unsigned char)sizeof(T);
    }
}

#define DD_COPY_LOAD(p, i) emu_load((p) + (i))
#define DD_COPY_STORE(p, i, v) emu_store((p) + (i), (v))

#include "dd_copy.cu"

/* The macros dd_copy.cu defines, for the test to compare with the generated header. */
extern "C" unsigned int dd_emulate_threads(void) { return DD_COPY_KERNEL_THREADS; }
extern "C" unsigned int dd_emulate_piece_bytes(void) { return DD_COPY_KERNEL_PIECE_BYTES; }

/*
 * One launch, dd_copy_descs<<<grid, block>>>(descs, count), with checked accesses. Returns the number
 * of access errors (the first described in `error`).
 */
extern "C" unsigned long long dd_emulate_launch(const void *descs, unsigned long long count, unsigned int grid,
                                                unsigned int block, uintptr_t src_base, size_t src_len,
                                                const unsigned char *readable, uintptr_t dst_base, size_t dst_len,
                                                unsigned char *writes, unsigned char *width, char *error,
                                                size_t error_len)
{
    emu_src_base = src_base;
    emu_src_len = src_len;
    emu_readable = readable;
    emu_dst_base = dst_base;
    emu_dst_len = dst_len;
    emu_writes = writes;
    emu_width = width;
    emu_errors = 0;
    emu_first_error[0] = '\0';
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned int b = 0; b < grid; ++b)
        for (unsigned int t = 0; t < block; ++t) {
            blockIdx = {b, 0, 0};
            threadIdx = {t, 0, 0};
            dd_copy_descs(static_cast<const dd_copy_desc *>(descs), count);
        }
    if (error_len) {
        strncpy(error, emu_first_error, error_len - 1);
        error[error_len - 1] = '\0';
    }
    return emu_errors;
}
