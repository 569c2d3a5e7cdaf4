// Lane layouts of the warp-level tensor-core instructions the tiled kernels use (kernels/mma_tiles.cuh), as
// __host__ __device__ index math so that the CPU emulation (testing/mma_emulation.h) places every element where the
// hardware does. Transcribed from the PTX ISA, section 9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with floating
// point type" and the ldmatrix description (9.7.14.5.15):
//
//   mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32  D[16x8] = A[16x16] B[16x8] + C[16x8]
//     groupID = lane >> 2, threadID_in_group = lane % 4
//     A: four .b32 registers, each two 16-bit elements a_{2r}, a_{2r+1} (low half first):
//        row = groupID (+ 8 for registers 1 and 3), col = 2 threadID_in_group + (0, 1) (+ 8 for registers 2 and 3)
//     B: two .b32 registers: row (k) = 2 threadID_in_group + (0, 1) (+ 8 for register 1), col (n) = groupID
//     C, D: four floats: row = groupID (+ 8 for elements 2 and 3), col = 2 threadID_in_group + (element & 1)
//   ldmatrix.sync.aligned.m8n8.x4.shared.b16: lanes 8q .. 8q + 7 give the addresses of rows 0..7 of matrix q;
//     register q of every lane then holds row (lane >> 2), columns 2 (lane % 4) and 2 (lane % 4) + 1 of matrix q.
#pragma once

#include "criticalkv/common.h"

namespace criticalkv::mma
{

constexpr int32_t kTileM = 16; //!< rows of A, C (m16)
constexpr int32_t kTileN = 8;  //!< columns of B, C (n8)
constexpr int32_t kTileK = 16; //!< k16

struct RowCol
{
    int32_t row;
    int32_t col;
};

//! Element (row, col) of A held in the low half of register `reg` (0..3) of `lane`; the high half is (row, col + 1).
CKV_HD RowCol aFragment(int32_t lane, int32_t reg)
{
    return RowCol{(lane >> 2) + 8 * (reg & 1), 2 * (lane & 3) + 8 * (reg >> 1)};
}

//! Element (k, n) of B held in the low half of register `reg` (0..1) of `lane`; the high half is (k + 1, n).
CKV_HD RowCol bFragment(int32_t lane, int32_t reg)
{
    return RowCol{2 * (lane & 3) + 8 * reg, lane >> 2};
}

//! Element (row, col) of C / D held in float `element` (0..3) of `lane`.
CKV_HD RowCol cFragment(int32_t lane, int32_t element)
{
    return RowCol{(lane >> 2) + 8 * (element >> 1), 2 * (lane & 3) + (element & 1)};
}

//! ldmatrix.x4: the (row, first column) of its matrix whose two elements `lane` receives in every register.
CKV_HD RowCol ldmatrixElement(int32_t lane)
{
    return RowCol{lane >> 2, 2 * (lane & 3)};
}

//! ldmatrix.x4 of a 16 x 16 A tile (row-major, k contiguous): the (row, col) whose address `lane` supplies, so that
//! registers 0..3 are A's fragment (matrix q = lane >> 3: rows 8 (q & 1), columns 8 (q >> 1)).
CKV_HD RowCol ldmatrixARow(int32_t lane)
{
    return RowCol{(lane & 7) + 8 * ((lane >> 3) & 1), 8 * (lane >> 4)};
}

//! ldmatrix.x4 of two n8 x k16 B tiles stored [n][k] (k contiguous, "col" B): the (n, k) whose address `lane`
//! supplies; registers 0, 1 are the B fragment of columns n 0..7, registers 2, 3 that of columns 8..15.
CKV_HD RowCol ldmatrixBRow(int32_t lane)
{
    return RowCol{(lane & 7) + 8 * (lane >> 4), 8 * ((lane >> 3) & 1)};
}

//! Element offsets (in a tile of row stride `stride`, 16-bit elements) of the row `lane` gives an ldmatrix.x4: A
//! fragments of rows [row0, row0 + 16) at depth k0 (tile [row][k]); B fragments of columns [col0, col0 + 16) at depth
//! k0 (tile [n][k]). The tile bodies load through them and the bank analysis checks them.
CKV_HD int32_t fragmentAOffset(int32_t stride, int32_t row0, int32_t k0, int32_t lane)
{
    RowCol const ar = ldmatrixARow(lane);
    return (row0 + ar.row) * stride + k0 + ar.col;
}

CKV_HD int32_t fragmentBOffset(int32_t stride, int32_t col0, int32_t k0, int32_t lane)
{
    RowCol const br = ldmatrixBRow(lane);
    return (col0 + br.row) * stride + k0 + br.col;
}

//! Shared-memory row stride (16-bit elements) of a tile whose rows hold `depth` elements (depth % 8 == 0): 8 elements
//! (16 bytes) of padding make the stride an odd number of 16-byte chunks, so the 8 rows one ldmatrix phase reads fall
//! in 8 different 16-byte bank groups (no bank conflict) for every depth % 16 == 0, and every row stays 16-byte
//! aligned for cp.async.
CKV_HD int32_t paddedStride(int32_t depth)
{
    return depth + 8;
}

} // namespace criticalkv::mma
