#version 450
// argmax.comp -- greedy sampling on the device: the index of the largest logit, written where the
// next step's embedding reads its token id.
// Contract: logits float32 (V,), finite or -inf; tok: uint32, element 0 written. One workgroup.
// numpy: tok[0] = np.argmax(logits)   (ties: the smallest index, as numpy and torch)
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint V = 64;
layout(std430, binding = 0) readonly buffer Lb { float logits[]; };
layout(std430, binding = 1) buffer Tb { uint tok[]; };
shared float bv[256];
shared uint bi[256];

void main() {
    const uint lid = gl_LocalInvocationID.x;
    float best = uintBitsToFloat(0xff800000u);      // -inf
    uint idx = lid < V ? lid : 0xffffffffu;
    for (uint i = lid; i < V; i += 256) {
        const float v = logits[i];
        if (v > best) { best = v; idx = i; }        // strict: the first of equal values
    }
    bv[lid] = best;
    bi[lid] = idx;
    barrier();
    for (uint h = 128; h > 0; h >>= 1) {
        if (lid < h) {
            const float o = bv[lid + h];
            const uint oi = bi[lid + h];
            if (o > bv[lid] || (o == bv[lid] && oi < bi[lid])) { bv[lid] = o; bi[lid] = oi; }
        }
        barrier();
    }
    if (lid == 0) tok[0] = bi[0];
}
