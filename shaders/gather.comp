#version 450
// gather.comp -- copy cache rows start .. start+count-1 of every head into a readback buffer.
//
// Contract
//   kc, vc : cache [HKV, CAP, DK4|DV4] uvec4 (common.glsl), read only
//   rk, rv : [HKV, ROWS, DK4|DV4] uvec4, rows 0 .. count-1 written
//   params : [0] start, [1] count (<= ROWS)
//   ks, vs -> rks, rvs : KV_I8: the rows' scales, float32 [HKV, CAP] -> [HKV, ROWS]
// numpy:  rk[:, :count] = K[:, start:start+count];  rv[:, :count] = V[:, start:start+count]
// Used by KVCache.read(): bounded memory (ROWS rows per head), O(length) work.
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint DK4 = 16u;
layout(constant_id = 2) const uint DV4 = 16u;
layout(constant_id = 3) const uint CAP = 1u;
layout(constant_id = 4) const uint HKV = 1u;
layout(constant_id = 5) const uint ROWS = 1u;

layout(std430, binding = 0) readonly buffer KC { uvec4 kc[]; };
layout(std430, binding = 1) readonly buffer VC { uvec4 vc[]; };
layout(std430, binding = 2) writeonly buffer RK { uvec4 rk[]; };
layout(std430, binding = 3) writeonly buffer RV { uvec4 rv[]; };
layout(std430, binding = 4) readonly buffer PARAMS { uint params[]; };
layout(std430, binding = 5) readonly buffer KS { float ks[]; };
layout(std430, binding = 6) readonly buffer VS { float vs[]; };
layout(std430, binding = 7) writeonly buffer RKS { float rks[]; };
layout(std430, binding = 8) writeonly buffer RVS { float rvs[]; };
#ifndef KV_I8
#define KV_I8 0
#endif

void main() {
    const uint start = params[0], count = params[1];
    const uint nk = HKV * count * DK4;
    const uint total = nk + HKV * count * DV4;
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < total; i += stride) {
        if (i < nk) {
            const uint c = i % DK4, r = (i / DK4) % count, h = i / (DK4 * count);
            rk[(h * ROWS + r) * DK4 + c] = kc[(h * CAP + start + r) * DK4 + c];
        } else {
            const uint iv = i - nk;
            const uint c = iv % DV4, r = (iv / DV4) % count, h = iv / (DV4 * count);
            rv[(h * ROWS + r) * DV4 + c] = vc[(h * CAP + start + r) * DV4 + c];
        }
    }
#if KV_I8
    for (uint i = gl_GlobalInvocationID.x; i < HKV * count; i += stride) {
        const uint h = i / count, r = i % count;
        rks[h * ROWS + r] = ks[h * CAP + start + r];
        rvs[h * ROWS + r] = vs[h * CAP + start + r];
    }
#endif
}
