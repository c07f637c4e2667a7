#version 450
// merge_lse.comp -- two attention results over disjoint key sets of the same query rows combined
// into the result over their union, row by row through the log-sum-exp (PagedKVCache cascade:
// each sequence's own keys, and the shared prefix its group attended once; vkattn/cascade.py).
//
// Contract
//   ao, al : float32 [NR, DV] normalised outputs and [NR] natural log-sum-exps (-inf: the row saw
//            no key) of part a; NR = HQ * R, row h*R + r (query head h, packed row r)
//   bo, bl : the same for part b, [HQ * RB, DV] and [HQ * RB]
//   params : [0] NR (rows this call, all heads; 0: nothing to do), [1] R, [2] RB,
//            [3 + r] for r < R: the row of b (per head) that row r merges with, 0xffffffff: none
//   out, lse : float32 [NR, DV], [NR]: the merged rows (a row with no b row: a's row unchanged)
// numpy (rows r with a b row, vkattn.reference.merge_states):
//   out[:, r], lse[:, r] = merge_states(ao[:, r], al[:, r], bo[:, map[r]], bl[:, map[r]])
//   i.e. m = max(la, lb); wa = exp(la - m); wb = exp(lb - m) (0 for a side at -inf);
//        out = (wa * oa + wb * ob) / (wa + wb); lse = m + log(wa + wb); both -inf: zeros and -inf
//
// One invocation per (row, group of four output elements), a grid-stride loop over them. The
// weights sum to a value in [1, 2], where GLSL specifies division (2.5 ULP) and log (absolute
// error 2^-21); exp2 of a non-positive finite argument (the side at -inf is selected away, never
// evaluated as exp2(-inf)).
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint DV = 128u;    // v_head_dim

layout(std430, binding = 0) readonly buffer AO { float ao[]; };
layout(std430, binding = 1) readonly buffer AL { float al[]; };
layout(std430, binding = 2) readonly buffer BO { float bo[]; };
layout(std430, binding = 3) readonly buffer BL { float bl[]; };
layout(std430, binding = 4) readonly buffer PARAMS { uint params[]; };
layout(std430, binding = 5) writeonly buffer OUT { float outbuf[]; };
layout(std430, binding = 6) writeonly buffer LSE { float lsebuf[]; };

#define NEG_INF uintBitsToFloat(0xff800000u)
#define NONE 0xffffffffu
const float LOG2E = 1.4426950408889634;
const uint DV4 = (DV + 3u) / 4u;

void main() {
    const uint nr = params[0], R = params[1], RB = params[2];
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < nr * DV4; i += stride) {
        const uint row = i / DV4, c = i % DV4;
        const uint h = row / R, r = row % R;
        const uint brow = params[3u + r];
        const float la = al[row];
        float wa = 1.0, wb = 0.0, lse = la;
        uint bi = 0u;
        if (brow != NONE) {
            bi = h * RB + brow;
            const float lb = bl[bi];
            const float m = max(la, lb);
            if (m == NEG_INF) {                   // neither part saw a key
                wa = 0.0;
                lse = NEG_INF;
            } else {
                wa = la == NEG_INF ? 0.0 : exp2((la - m) * LOG2E);
                wb = lb == NEG_INF ? 0.0 : exp2((lb - m) * LOG2E);
                const float s = wa + wb;           // in [1, 2]: the larger weight is exp2(0) = 1
                lse = m + log(s);
                wa /= s;
                wb /= s;
            }
        }
        for (uint e = 0u; e < 4u; ++e) {
            const uint d = c * 4u + e;
            if (DV % 4u == 0u || d < DV) {
                float y = wa * ao[row * DV + d];
                if (wb != 0.0) y += wb * bo[bi * DV + d];
                outbuf[row * DV + d] = y;
            }
        }
        if (c == 0u) lsebuf[row] = lse;
    }
}
