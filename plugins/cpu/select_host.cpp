#include "select_host.h"

#include "criticalkv/budget.h"
#include "criticalkv/radix.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace criticalkv::host
{
namespace
{

void validateShape(SelectConfig const& config, SelectShape const& s)
{
    if (s.batch <= 0 || s.heads <= 0 || s.kvHeads <= 0 || s.n <= 0 || s.headDim <= 0 || s.hidden <= 0)
    {
        throw std::invalid_argument("shape: every dimension must be positive");
    }
    if (s.heads % s.kvHeads != 0)
    {
        throw std::invalid_argument("queries: " + std::to_string(s.heads) + " query heads are not a multiple of "
            + std::to_string(s.kvHeads) + " KV heads");
    }
    if (s.queryLen < windowLength(config, s.n))
    {
        throw std::invalid_argument("queries: " + std::to_string(s.queryLen)
            + " window queries given, the policy needs min(window, n) = " + std::to_string(windowLength(config, s.n)));
    }
    if (config.capacity <= 0)
    {
        throw std::invalid_argument("capacity: must be positive");
    }
}

//! Ā and sum_j A_j^2 of query head h over the m older positions (window attention, causal inside the window).
void windowScores(SelectConfig const& config, SelectShape const& s, HostInputs const& in, int32_t b, int32_t h,
    int32_t validStart, std::vector<float>& raw, std::vector<float>& squares)
{
    int32_t const n = s.n;
    int32_t const d = s.headDim;
    int32_t const w = windowLength(config, n);
    int32_t const m = n - w;
    int32_t const g = h / (s.heads / s.kvHeads);
    float const scale = static_cast<float>(std::sqrt(static_cast<double>(d)));
    float const* keys = in.keys + (static_cast<int64_t>(b) * s.kvHeads + g) * n * d;
    std::fill(raw.begin(), raw.end(), 0.0F);
    std::fill(squares.begin(), squares.end(), 0.0F);
    std::vector<float> logits(static_cast<size_t>(n));
    for (int32_t j = 0; j < w; ++j)
    {
        float const* q = in.queries + ((static_cast<int64_t>(b) * s.heads + h) * s.queryLen + (s.queryLen - w + j)) * d;
        int32_t const last = n - w + j; // keys <= last are visible, and keys >= validStart
        float rowMax = -INFINITY;
        for (int32_t i = validStart; i <= last; ++i)
        {
            float dot = 0.0F;
            for (int32_t k = 0; k < d; ++k)
            {
                dot += q[k] * keys[static_cast<int64_t>(i) * d + k];
            }
            logits[i] = dot / scale;
            rowMax = std::max(rowMax, logits[i]);
        }
        if (validStart > last)
        {
            continue; // a padded query of a short sequence: never scored
        }
        float sum = 0.0F;
        for (int32_t i = validStart; i <= last; ++i)
        {
            sum += std::exp(logits[i] - rowMax);
        }
        for (int32_t i = validStart; i < std::min(m, last + 1); ++i)
        {
            float const p = std::exp(logits[i] - rowMax) / sum;
            raw[i] += p;
            squares[i] += p * p;
        }
    }
    for (int32_t i = 0; i < m; ++i)
    {
        raw[i] /= static_cast<float>(w);
    }
}

void maxPool(std::vector<float> const& raw, int32_t m, int32_t kernel, std::vector<float>& pooled)
{
    int32_t const half = kernel / 2;
    for (int32_t i = 0; i < m; ++i)
    {
        float best = raw[i];
        for (int32_t t = std::max(0, i - half); t <= std::min(m - 1, i + half); ++t)
        {
            best = std::max(best, raw[t]);
        }
        pooled[i] = best;
    }
}

} // namespace

void valueProjectionNorms(SelectShape const& s, float const* values, float const* oProj, int32_t b, int32_t h,
    int32_t count, ValueNorm kind, float* out)
{
    int32_t const d = s.headDim;
    int64_t const ld = static_cast<int64_t>(s.heads) * d; // o_proj row length
    int32_t const g = h / (s.heads / s.kvHeads);
    float const* v = values + (static_cast<int64_t>(b) * s.kvHeads + g) * s.n * d;
    float const* w = oProj + static_cast<int64_t>(h) * d; // W_O^h[k, c] = w[c * ld + k]
    if (kind == ValueNorm::kL2)
    {
        std::vector<float> gram(static_cast<size_t>(d) * d, 0.0F);
        for (int32_t k = 0; k < d; ++k)
        {
            for (int32_t l = 0; l < d; ++l)
            {
                float acc = 0.0F;
                for (int32_t c = 0; c < s.hidden; ++c)
                {
                    acc += w[c * ld + k] * w[c * ld + l];
                }
                gram[static_cast<size_t>(k) * d + l] = acc;
            }
        }
        std::vector<float> u(static_cast<size_t>(d));
        for (int32_t i = 0; i < count; ++i)
        {
            float const* vi = v + static_cast<int64_t>(i) * d;
            for (int32_t l = 0; l < d; ++l)
            {
                float acc = 0.0F;
                for (int32_t k = 0; k < d; ++k)
                {
                    acc += vi[k] * gram[static_cast<size_t>(k) * d + l];
                }
                u[l] = acc;
            }
            float quad = 0.0F;
            for (int32_t l = 0; l < d; ++l)
            {
                quad += u[l] * vi[l];
            }
            out[i] = std::sqrt(std::max(quad, 0.0F));
        }
        return;
    }
    for (int32_t i = 0; i < count; ++i)
    {
        float const* vi = v + static_cast<int64_t>(i) * d;
        float norm = 0.0F;
        for (int32_t c = 0; c < s.hidden; ++c)
        {
            float dot = 0.0F;
            for (int32_t k = 0; k < d; ++k)
            {
                dot += vi[k] * w[c * ld + k];
            }
            norm += std::fabs(dot);
        }
        out[i] = norm;
    }
}

void selectTopK(float const* scores, uint8_t* flags, int64_t len, int64_t period, int64_t firstValid, int64_t k,
    uint8_t mark)
{
    if (k <= 0)
    {
        return;
    }
    auto candidate = [&](int64_t e) { return flags[e] == 0 && (e % period) >= firstValid; };
    uint32_t prefix = 0;
    uint32_t prefixMask = 0;
    int64_t remaining = k;
    for (int pass = 0; pass < kRadixPasses; ++pass)
    {
        uint32_t histogram[kRadixBins] = {};
        for (int64_t e = 0; e < len; ++e)
        {
            if (!candidate(e))
            {
                continue;
            }
            uint32_t const key = orderedKey(scores[e]);
            if ((key & prefixMask) == prefix)
            {
                ++histogram[radixDigit(key, pass)];
            }
        }
        if (pass == 0)
        {
            int64_t total = 0;
            for (uint32_t count : histogram)
            {
                total += count;
            }
            if (k >= total) // every candidate is kept
            {
                for (int64_t e = 0; e < len; ++e)
                {
                    if (candidate(e))
                    {
                        flags[e] = mark;
                    }
                }
                return;
            }
        }
        DigitChoice const choice = chooseDigit(histogram, remaining);
        prefix |= choice.digit << (32 - kRadixBits * (pass + 1));
        prefixMask = radixPrefixMask(pass);
        remaining -= choice.above;
    }
    // prefix is now the key T of the k-th best candidate: keep every candidate above T and the first
    // `remaining` (in index order) of the candidates equal to T.
    int64_t tiesTaken = 0;
    for (int64_t e = 0; e < len; ++e)
    {
        if (!candidate(e))
        {
            continue;
        }
        uint32_t const key = orderedKey(scores[e]);
        if (key > prefix)
        {
            flags[e] = mark;
        }
        else if (key == prefix && tiesTaken < remaining)
        {
            flags[e] = mark;
            ++tiesTaken;
        }
    }
}

void selectLayer(SelectConfig const& config, SelectShape const& s, HostInputs const& in, HostOutputs const& out)
{
    validateShape(config, s);
    int32_t const n = s.n;
    int32_t const d = s.headDim;
    int32_t const group = s.heads / s.kvHeads;
    int32_t const w = windowLength(config, n);
    int32_t const m = n - w;
    int32_t const cap = outputCapacity(config, n);
    int64_t const rowsPerBatch = static_cast<int64_t>(s.kvHeads) * m;

    std::vector<SequenceInfo> infos(static_cast<size_t>(s.batch));
    bool anyScored = false;
    for (int32_t b = 0; b < s.batch; ++b)
    {
        infos[b] = sequenceInfo(config, s, in.promptLengths, b);
        anyScored = anyScored || (infos[b].compress && needsScores(config));
    }

    std::vector<uint8_t> flags(static_cast<size_t>(s.batch * rowsPerBatch), 0);
    if (anyScored)
    {
        std::vector<float> attention(flags.size(), 0.0F);
        std::vector<float> critical(flags.size(), 0.0F);
        std::vector<float> laprox(flags.size(), 0.0F);
        std::vector<float> raw(static_cast<size_t>(m)), squares(static_cast<size_t>(m)), pooled(static_cast<size_t>(m)),
            norms(static_cast<size_t>(m));
        std::vector<float> sumPooled(static_cast<size_t>(m)), sumCritical(static_cast<size_t>(m)),
            sumP(static_cast<size_t>(m)), sumN(static_cast<size_t>(m)), sumL(static_cast<size_t>(m));
        for (int32_t b = 0; b < s.batch; ++b)
        {
            SequenceInfo const& info = infos[b];
            if (!info.compress)
            {
                continue;
            }
            for (int32_t g = 0; g < s.kvHeads; ++g)
            {
                std::fill(sumPooled.begin(), sumPooled.end(), 0.0F);
                std::fill(sumCritical.begin(), sumCritical.end(), 0.0F);
                std::fill(sumP.begin(), sumP.end(), 0.0F);
                std::fill(sumN.begin(), sumN.end(), 0.0F);
                std::fill(sumL.begin(), sumL.end(), 0.0F);
                for (int32_t h = g * group; h < (g + 1) * group; ++h)
                {
                    windowScores(config, s, in, b, h, info.validStart, raw, squares);
                    maxPool(raw, m, config.poolKernel, pooled);
                    if (needsNorms(config))
                    {
                        valueProjectionNorms(s, in.values, in.oProj, b, h, m, normKind(config), norms.data());
                    }
                    std::vector<float> const& p = config.stage2Scores == Stage2Scores::kPooled ? pooled : raw;
                    for (int32_t i = 0; i < m; ++i)
                    {
                        sumPooled[i] += pooled[i];
                        if (config.twoStage)
                        {
                            sumCritical[i] += (p[i] + config.epsilon) * norms[i];
                            sumP[i] += p[i];
                            sumN[i] += norms[i];
                        }
                        if (config.base == BaseMethod::kLaProx)
                        {
                            sumL[i] += std::sqrt(squares[i]) * norms[i];
                        }
                    }
                }
                int64_t const row = b * rowsPerBatch + static_cast<int64_t>(g) * m;
                float const groupSize = static_cast<float>(group);
                for (int32_t i = 0; i < m; ++i)
                {
                    attention[row + i] = sumPooled[i] / groupSize;
                    critical[row + i] = config.gqaReduce == GqaReduce::kMean
                        ? sumCritical[i] / groupSize
                        : (sumP[i] / groupSize + config.epsilon) * (sumN[i] / groupSize);
                    laprox[row + i] = sumL[i];
                }
            }

            // Selection of the older tokens (criticalkv/selection/layer.py: choose_older_tokens).
            int64_t const base = b * rowsPerBatch;
            auto twoStage = [&](int32_t g, int64_t count) {
                int64_t const row = base + static_cast<int64_t>(g) * m;
                int64_t const first = config.twoStage ? stage1Count(config.alpha, count) : count;
                selectTopK(&attention[row], &flags[row], m, m, info.validStart, first, 1);
                if (config.twoStage)
                {
                    selectTopK(&critical[row], &flags[row], m, m, info.validStart, count - first, 2);
                }
            };
            if (!sharedAllocation(config))
            {
                for (int32_t g = 0; g < s.kvHeads; ++g)
                {
                    twoStage(g, info.r);
                }
                continue;
            }
            float const* ranking = config.base == BaseMethod::kLaProx ? &laprox[base] : &attention[base];
            int64_t const floor = headFloor(config.adaFloor, info.r);
            for (int32_t g = 0; g < s.kvHeads; ++g)
            {
                int64_t const offset = static_cast<int64_t>(g) * m;
                selectTopK(ranking + offset, &flags[base + offset], m, m, info.validStart, floor, 1);
            }
            selectTopK(ranking, &flags[base], rowsPerBatch, m, info.validStart, s.kvHeads * (info.r - floor), 1);
            if (config.twoStage)
            {
                for (int32_t g = 0; g < s.kvHeads; ++g)
                {
                    uint8_t* row = &flags[base + static_cast<int64_t>(g) * m];
                    int64_t const share = std::count_if(row, row + m, [](uint8_t f) { return f != 0; });
                    std::fill(row, row + m, 0);
                    twoStage(g, share);
                }
            }
        }
    }

    // Compaction: ascending kept positions, then the gather of K and V.
    for (int32_t b = 0; b < s.batch; ++b)
    {
        SequenceInfo const& info = infos[b];
        for (int32_t g = 0; g < s.kvHeads; ++g)
        {
            std::vector<int32_t> kept;
            if (!info.compress)
            {
                for (int32_t i = info.validStart; i < n; ++i)
                {
                    kept.push_back(i);
                }
            }
            else if (config.base == BaseMethod::kStreamingLLM)
            {
                for (int32_t i = info.validStart; i < info.validStart + config.sinkTokens; ++i)
                {
                    kept.push_back(i);
                }
                for (int32_t i = n - (config.budget - config.sinkTokens); i < n; ++i)
                {
                    kept.push_back(i);
                }
            }
            else
            {
                uint8_t const* row = &flags[b * rowsPerBatch + static_cast<int64_t>(g) * m];
                for (int32_t i = 0; i < n; ++i)
                {
                    if (i >= m || (i >= info.validStart && row[i] != 0))
                    {
                        kept.push_back(i);
                    }
                }
            }
            int64_t const head = static_cast<int64_t>(b) * s.kvHeads + g;
            int32_t const count = std::min(static_cast<int32_t>(kept.size()), cap);
            out.keptLengths[head] = count;
            for (int32_t slot = 0; slot < cap; ++slot)
            {
                int32_t const index = slot < count ? kept[slot] : -1;
                out.keptIndices[head * cap + slot] = index;
                for (float* dst : {out.keptKeys, out.keptValues})
                {
                    if (dst == nullptr)
                    {
                        continue;
                    }
                    float const* src = dst == out.keptKeys ? in.keys : in.values;
                    for (int32_t k = 0; k < d; ++k)
                    {
                        dst[(head * cap + slot) * d + k] = index >= 0 ? src[(head * n + index) * d + k] : 0.0F;
                    }
                }
            }
        }
    }
}

} // namespace criticalkv::host
