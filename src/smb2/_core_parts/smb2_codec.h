/* smb2._core's frame codec (codec.pxi): little-endian words at any alignment. */
#ifndef SMB2_CODEC_H
#define SMB2_CODEC_H

#include <string.h>
#include <stdint.h>
/* x86 and aarch64 are little endian; memcpy keeps unaligned access defined. */
static inline void smb2_put16(char *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void smb2_put32(char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void smb2_put64(char *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint16_t smb2_get16(const char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t smb2_get32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t smb2_get64(const char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

#endif /* SMB2_CODEC_H */
