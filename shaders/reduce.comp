#version 450
// reduce.comp -- merge the SPLITS partial results of attn.comp (split-K flash decoding).
//
// Contract
//   part : float32 [SPLITS, NROWS, PV4] un-normalised sums (PV4 = padded v_head_dim)
//   ml   : vec2 [SPLITS, NROWS] (running max in log2 units, running sum)
//   out  : float32 [NROWS, DV]
//   lse  : float32 [NROWS], natural log-sum-exp of the row's scores (-inf: no key seen)
// numpy:  w = exp2(m - m.max(0));  out = (w[..., None] * part).sum(0) / (w * l).sum(0)
//         lse = (m.max(0) + log2((w * l).sum(0))) * ln(2)   (a row no split saw: zeros, -inf)
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint SPLITS = 1u;
layout(constant_id = 2) const uint NROWS = 1u;
layout(constant_id = 3) const uint DV = 128u;
layout(constant_id = 4) const uint PV4 = 128u;

layout(std430, binding = 0) readonly buffer PART { float part[]; };
layout(std430, binding = 1) readonly buffer ML { vec2 ml[]; };
layout(std430, binding = 2) writeonly buffer OUT { float outbuf[]; };
layout(std430, binding = 3) writeonly buffer LSE { float lsebuf[]; };

void main() {
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < NROWS * DV; i += stride) {
        const uint row = i / DV, d = i % DV;
        float m = uintBitsToFloat(0xff800000u);
        for (uint s = 0u; s < SPLITS; ++s) m = max(m, ml[s * NROWS + row].x);
        float o = 0.0, l = 0.0;
        if (m != uintBitsToFloat(0xff800000u)) {
            for (uint s = 0u; s < SPLITS; ++s) {
                const vec2 x = ml[s * NROWS + row];
                const float w = exp2(x.x - m);
                l += w * x.y;
                o += w * part[(s * NROWS + row) * PV4 + d];
            }
        }
        outbuf[i] = l > 0.0 ? o / l : 0.0;
        if (d == 0u) lsebuf[row] = l > 0.0 ? (m + log2(l)) * 0.6931471805599453 : uintBitsToFloat(0xff800000u);
    }
}
