#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
// embed.comp -- token embedding: a gather by token ids that live in device memory.
// Contract: E (V, K) row-major in a storage format of weights.glsl, K a multiple of its UNIT;
// ids: T uint32 token ids (each < V: an id past the table reads row V - 1); x (T, K) float32.
// numpy: x = E[ids[:T]].astype(np.float32)
// One invocation per UNIT features of a token; grid (ceil(K / UNIT / 64), T).
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint K = 64;
layout(constant_id = 1) const uint V = 64;
#include "weights.glsl"
layout(std430, binding = 1) readonly buffer Ib { uint ids[]; };
layout(std430, binding = 2) writeonly buffer Xb { float x[]; };

void main() {
    const uint c = gl_GlobalInvocationID.x, t = gl_WorkGroupID.y;
    if (c >= PIECES) return;
    vec4 wv[V4];
    load_piece(min(ids[t], V - 1), c, wv);
    const uint o = t * K + c * UNIT;
    for (uint i = 0; i < V4; i++) {
        for (uint e = 0; e < 4; e++) x[o + 4 * i + e] = wv[i][e];
    }
}
