#version 450
// embed.comp -- token embedding: a gather by token ids that live in device memory.
// Contract: E (V, K) row-major, float16 two per uint32 (W_F16) or float32, K a multiple of 8;
// ids: T uint32 token ids (each < V: an id past the table reads row V - 1); x (T, K) float32.
// numpy: x = E[ids[:T]].astype(np.float32)
// One invocation per 8 features of a token; grid (ceil(K / 8 / 64), T).
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint K = 64;
layout(constant_id = 1) const uint V = 64;
#ifdef W_F16
layout(std430, binding = 0) readonly buffer Eb { uvec4 e[]; };
#else
layout(std430, binding = 0) readonly buffer Eb { vec4 e[]; };
#endif
layout(std430, binding = 1) readonly buffer Ib { uint ids[]; };
layout(std430, binding = 2) writeonly buffer Xb { float x[]; };

void main() {
    const uint c = gl_GlobalInvocationID.x, t = gl_WorkGroupID.y;
    if (c >= K / 8) return;
    const uint row = min(ids[t], V - 1);
    vec4 a, b;
#ifdef W_F16
    uvec4 u = e[row * (K / 8) + c];
    a = vec4(unpackHalf2x16(u.x), unpackHalf2x16(u.y));
    b = vec4(unpackHalf2x16(u.z), unpackHalf2x16(u.w));
#else
    a = e[(row * (K / 8) + c) * 2];
    b = e[(row * (K / 8) + c) * 2 + 1];
#endif
    const uint o = t * K + c * 8;
    for (uint i = 0; i < 4; i++) {
        x[o + i] = a[i];
        x[o + 4 + i] = b[i];
    }
}
