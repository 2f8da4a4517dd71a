# Part of smb2._core, included by _core.pyx (which lists the parts): the frame
# header codec.

from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

# --------------------------------------------------------------------------
# Frame header
#
#   offset size field
#        0    2 magic       0x3253 ("S2" on the wire, little endian)
#        2    1 version
#        3    1 op
#        4    2 flags
#        6    2 status      0 = ok, else an ErrorCode (replies only)
#        8    4 request id
#       12    4 segment
#       16    8 offset
#       24    8 length      payload bytes that follow, or bytes asked for (READ)
#
# All fields little endian; docs/protocol.md is the written contract.

cdef enum:
    _HEADER_SIZE = 32
    _MAGIC = 0x3253

HEADER_SIZE = _HEADER_SIZE
MAGIC = _MAGIC

cdef extern from "smb2_codec.h":
    void smb2_put16(char *p, uint16_t v) nogil
    void smb2_put32(char *p, uint32_t v) nogil
    void smb2_put64(char *p, uint64_t v) nogil
    uint16_t smb2_get16(const char *p) nogil
    uint32_t smb2_get32(const char *p) nogil
    uint64_t smb2_get64(const char *p) nogil


cdef inline void _put_header(char *p, int version, int op, int flags, int status,
                             uint32_t request_id, uint32_t segment,
                             uint64_t offset, uint64_t length) noexcept nogil:
    smb2_put16(p, _MAGIC)
    p[2] = <char>version
    p[3] = <char>op
    smb2_put16(p + 4, <uint16_t>flags)
    smb2_put16(p + 6, <uint16_t>status)
    smb2_put32(p + 8, request_id)
    smb2_put32(p + 12, segment)
    smb2_put64(p + 16, offset)
    smb2_put64(p + 24, length)


def encode_header(int version, int op, int flags, int status, uint32_t request_id,
                  uint32_t segment, uint64_t offset, uint64_t length):
    """Return the 32-byte header as ``bytes``."""
    if not (0 <= version < 256 and 0 <= op < 256 and 0 <= flags < 65536
            and 0 <= status < 65536):
        raise ValueError("header field out of range")
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 32)
    _put_header(PyBytes_AS_STRING(out), version, op, flags, status,
                request_id, segment, offset, length)
    return out


def encode_header_with(int version, int op, int flags, int status, uint32_t request_id,
                       uint32_t segment, uint64_t offset, uint64_t length,
                       const uint8_t[::1] payload):
    """Return header + a small payload (atomics' operands, control messages) as
    one ``bytes``, so that one ``transport.write`` sends one frame."""
    cdef Py_ssize_t n = payload.shape[0]
    if not (0 <= version < 256 and 0 <= op < 256 and 0 <= flags < 65536
            and 0 <= status < 65536):
        raise ValueError("header field out of range")
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 32 + n)
    cdef char *p = PyBytes_AS_STRING(out)
    _put_header(p, version, op, flags, status, request_id, segment, offset, length)
    if n:
        memcpy(p + 32, &payload[0], n)
    return out


def decode_header(const uint8_t[::1] buf, Py_ssize_t pos=0):
    """Decode the header at ``buf[pos:pos+32]``.

    Returns ``(magic, version, op, flags, status, request_id, segment, offset,
    length)``; the caller validates magic and version (the receiver decides
    whether a bad frame closes the connection)."""
    if pos < 0 or buf.shape[0] - pos < 32:
        raise ValueError("need 32 bytes for a header")
    cdef const char *p = <const char *>&buf[pos]
    return (smb2_get16(p), <uint8_t>p[2], <uint8_t>p[3], smb2_get16(p + 4),
            smb2_get16(p + 6), smb2_get32(p + 8), smb2_get32(p + 12),
            smb2_get64(p + 16), smb2_get64(p + 24))


def pack_u64(uint64_t a):
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 8)
    smb2_put64(PyBytes_AS_STRING(out), a)
    return out


def pack_u64x2(uint64_t a, uint64_t b):
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 16)
    smb2_put64(PyBytes_AS_STRING(out), a)
    smb2_put64(PyBytes_AS_STRING(out) + 8, b)
    return out


def unpack_u64(const uint8_t[::1] buf, Py_ssize_t pos=0):
    if pos < 0 or buf.shape[0] - pos < 8:
        raise ValueError("need 8 bytes")
    return smb2_get64(<const char *>&buf[pos])
