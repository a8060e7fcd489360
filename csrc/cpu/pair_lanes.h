// The loads the VNNI build's 512-bit pair bodies share (x8_pairs.h for Q8_0 / Q4_0 / Q4_1,
// x8k_pairs.h for Q4_K / Q6_K): two adjacent groups of eight weight rows in one vector, group g in
// lanes 0-7 and group g + 1 in lanes 8-15. Included inside the including file's namespaces, after
// its target switch (the body headers have already pulled in <cstring> and the intrinsics).
#pragma once

namespace pairs {

// 32 bytes of each group (p0: group g's, p1: group g + 1's) -> one 512-bit vector.
inline __m512i load2(const uint8_t* p0, const uint8_t* p1) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1)), 1);
}
// 8 fp16 of each group -> 16 fp32 (the groups' scales).
inline __m512 halves2(const uint8_t* p0, const uint8_t* p1) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
}
// An activation's four bytes in every 32-bit lane (a vpbroadcastd from memory).
inline __m512i broadcast4x16(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

}  // namespace pairs
