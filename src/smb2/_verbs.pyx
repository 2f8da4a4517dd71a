# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""A small libibverbs wrapper for smb2's RDMA data path.

Only what smb2 needs, written against ``infiniband/verbs.h`` directly (no
pyverbs ``.pxd``: Debian ships none, and pyverbs 44 does not expose the fd of
a completion channel):

* :class:`Context` (a device), :class:`PD`, :class:`MR` (over any writable
  buffer-protocol object, kept alive and pinned while registered),
* :class:`CQ` with its *own* completion channel, whose ``fd`` an event loop
  watches (``loop.add_reader``),
* :class:`QP` (RC) with the INIT -> RTR -> RTS transitions and posting of
  RDMA READ/WRITE (SGE lists) and the two atomics,
* :class:`Completions`: a table of waiting futures indexed by ``wr_id``; its
  ``drain`` polls the CQ in batches into a C array of ``ibv_wc`` and resolves
  the futures directly -- no Python object is made per completion.

Every native object has an idempotent ``close()``; a parent's ``close()``
closes its children first (pyverbs' rule), so closing a Context releases
everything made from it.  Errors are ``VerbsError`` (an ``OSError`` carrying
the errno); the transport turns them into ``smb2.TransportError``.
"""

cimport cython
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE,
                             PyBUF_SIMPLE, PyBUF_ANY_CONTIGUOUS)
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.errno cimport errno, EAGAIN
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset, memcpy, strerror

import os
import weakref

cdef extern from "<fcntl.h>" nogil:
    int fcntl(int fd, int cmd, ...)
    enum:
        F_GETFL
        F_SETFL
        O_NONBLOCK

cdef extern from "infiniband/verbs.h" nogil:
    struct ibv_device:
        pass
    struct ibv_context:
        int async_fd
    struct ibv_pd:
        pass
    struct ibv_mr:
        void *addr
        size_t length
        uint32_t lkey
        uint32_t rkey
    struct ibv_comp_channel:
        int fd
    struct ibv_cq:
        pass
    struct ibv_qp:
        uint32_t qp_num
    union ibv_gid:
        uint8_t raw[16]

    struct ibv_device_attr:
        char fw_ver[64]
        uint64_t max_mr_size
        int max_qp_wr
        int max_sge
        int max_cqe
        int max_qp_rd_atom
        int max_qp_init_rd_atom
        int atomic_cap
    struct ibv_port_attr:
        int state
        int max_mtu
        int active_mtu
        int gid_tbl_len
        uint32_t max_msg_sz
        uint16_t lid
        uint8_t link_layer

    struct ibv_global_route:
        ibv_gid dgid
        uint32_t flow_label
        uint8_t sgid_index
        uint8_t hop_limit
        uint8_t traffic_class
    struct ibv_ah_attr:
        ibv_global_route grh
        uint16_t dlid
        uint8_t sl
        uint8_t src_path_bits
        uint8_t static_rate
        uint8_t is_global
        uint8_t port_num
    struct ibv_qp_cap:
        uint32_t max_send_wr
        uint32_t max_recv_wr
        uint32_t max_send_sge
        uint32_t max_recv_sge
        uint32_t max_inline_data
    struct ibv_qp_init_attr:
        void *qp_context
        ibv_cq *send_cq
        ibv_cq *recv_cq
        ibv_qp_cap cap
        int qp_type
        int sq_sig_all
    struct ibv_qp_attr:
        int qp_state
        int path_mtu
        uint32_t rq_psn
        uint32_t sq_psn
        uint32_t dest_qp_num
        unsigned int qp_access_flags
        ibv_ah_attr ah_attr
        uint16_t pkey_index
        uint8_t max_rd_atomic
        uint8_t max_dest_rd_atomic
        uint8_t min_rnr_timer
        uint8_t port_num
        uint8_t timeout
        uint8_t retry_cnt
        uint8_t rnr_retry

    struct ibv_sge:
        uint64_t addr
        uint32_t length
        uint32_t lkey
    # the members of ibv_send_wr's anonymous union ``wr`` (never named in C:
    # only their fields are accessed)
    struct _wr_rdma:
        uint64_t remote_addr
        uint32_t rkey
    struct _wr_atomic:
        uint64_t remote_addr
        uint64_t compare_add
        uint64_t swap
        uint32_t rkey
    union _wr_union:
        _wr_rdma rdma
        _wr_atomic atomic
    struct ibv_send_wr:
        uint64_t wr_id
        ibv_send_wr *next
        ibv_sge *sg_list
        int num_sge
        int opcode
        unsigned int send_flags
        _wr_union wr
    struct ibv_wc:
        uint64_t wr_id
        int status
        int opcode
        uint32_t vendor_err
        uint32_t byte_len
        uint32_t qp_num

    enum:
        IBV_ACCESS_LOCAL_WRITE
        IBV_ACCESS_REMOTE_WRITE
        IBV_ACCESS_REMOTE_READ
        IBV_ACCESS_REMOTE_ATOMIC
        IBV_QPT_RC
        IBV_QPS_RESET
        IBV_QPS_INIT
        IBV_QPS_RTR
        IBV_QPS_RTS
        IBV_QPS_ERR
        IBV_QP_STATE
        IBV_QP_CUR_STATE
        IBV_QP_ACCESS_FLAGS
        IBV_QP_PKEY_INDEX
        IBV_QP_PORT
        IBV_QP_AV
        IBV_QP_PATH_MTU
        IBV_QP_TIMEOUT
        IBV_QP_RETRY_CNT
        IBV_QP_RNR_RETRY
        IBV_QP_RQ_PSN
        IBV_QP_MAX_QP_RD_ATOMIC
        IBV_QP_MIN_RNR_TIMER
        IBV_QP_SQ_PSN
        IBV_QP_MAX_DEST_RD_ATOMIC
        IBV_QP_DEST_QPN
        IBV_WR_RDMA_WRITE
        IBV_WR_RDMA_READ
        IBV_WR_ATOMIC_CMP_AND_SWP
        IBV_WR_ATOMIC_FETCH_AND_ADD
        IBV_SEND_SIGNALED
        IBV_WC_SUCCESS
        IBV_WC_WR_FLUSH_ERR
        IBV_PORT_ACTIVE
        IBV_LINK_LAYER_ETHERNET
        IBV_ATOMIC_NONE

    ibv_device **ibv_get_device_list(int *num_devices)
    void ibv_free_device_list(ibv_device **lst)
    const char *ibv_get_device_name(ibv_device *device)
    ibv_context *ibv_open_device(ibv_device *device)
    int ibv_close_device(ibv_context *context)
    int ibv_query_device(ibv_context *context, ibv_device_attr *attr)
    int ibv_query_port(ibv_context *context, uint8_t port_num, ibv_port_attr *attr)
    int ibv_query_gid(ibv_context *context, uint8_t port_num, int index, ibv_gid *gid)
    ibv_pd *ibv_alloc_pd(ibv_context *context)
    int ibv_dealloc_pd(ibv_pd *pd)
    ibv_mr *ibv_reg_mr(ibv_pd *pd, void *addr, size_t length, int access)
    int ibv_dereg_mr(ibv_mr *mr)
    ibv_comp_channel *ibv_create_comp_channel(ibv_context *context)
    int ibv_destroy_comp_channel(ibv_comp_channel *channel)
    ibv_cq *ibv_create_cq(ibv_context *context, int cqe, void *cq_context,
                          ibv_comp_channel *channel, int comp_vector)
    int ibv_destroy_cq(ibv_cq *cq)
    int ibv_req_notify_cq(ibv_cq *cq, int solicited_only)
    int ibv_get_cq_event(ibv_comp_channel *channel, ibv_cq **cq, void **cq_context)
    void ibv_ack_cq_events(ibv_cq *cq, unsigned int nevents)
    int ibv_poll_cq(ibv_cq *cq, int num_entries, ibv_wc *wc)
    ibv_qp *ibv_create_qp(ibv_pd *pd, ibv_qp_init_attr *attr)
    int ibv_modify_qp(ibv_qp *qp, ibv_qp_attr *attr, int attr_mask)
    int ibv_destroy_qp(ibv_qp *qp)
    int ibv_post_send(ibv_qp *qp, ibv_send_wr *wr, ibv_send_wr **bad_wr)
    const char *ibv_wc_status_str(int status)


ACCESS_LOCAL_WRITE = IBV_ACCESS_LOCAL_WRITE
ACCESS_REMOTE_WRITE = IBV_ACCESS_REMOTE_WRITE
ACCESS_REMOTE_READ = IBV_ACCESS_REMOTE_READ
ACCESS_REMOTE_ATOMIC = IBV_ACCESS_REMOTE_ATOMIC
#: what a segment (and a staging area) is registered with
ACCESS_REMOTE_ALL = (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                     IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC)
WR_RDMA_WRITE = IBV_WR_RDMA_WRITE
WR_RDMA_READ = IBV_WR_RDMA_READ
WC_SUCCESS = IBV_WC_SUCCESS
WC_WR_FLUSH_ERR = IBV_WC_WR_FLUSH_ERR
PORT_ACTIVE = IBV_PORT_ACTIVE
LINK_LAYER_ETHERNET = IBV_LINK_LAYER_ETHERNET

# CQ entries polled per ibv_poll_cq call (a C array on the stack)
cdef enum:
    _BATCH = 32
    # SGEs per work request we ever post (rxe offers 32; every HCA >= 16)
    _MAX_SGE = 16


# Live native objects, so tests can assert that nothing leaked (uvloop counts
# its handles the same way).  Only touched with the GIL held.
cdef long _live_ctx = 0, _live_pd = 0, _live_mr = 0, _live_cq = 0, _live_qp = 0


def live_resources():
    """How many contexts, PDs, MRs, CQs and QPs are open in this process."""
    return {"context": _live_ctx, "pd": _live_pd, "mr": _live_mr, "cq": _live_cq, "qp": _live_qp}


class VerbsError(OSError):
    """A verbs call failed; ``errno`` is set where the library gave one."""


cdef _fail(str what, int err=0):
    if err <= 0:
        err = errno
    if err:
        raise VerbsError(err, f"{what} failed: {strerror(err).decode()}")
    raise VerbsError(f"{what} failed")


def wc_status_str(int status):
    """libibverbs' name of a work-completion status (e.g. 'remote access error')."""
    return ibv_wc_status_str(status).decode()


def device_names():
    """Names of the RDMA devices of this machine ([] when there are none)."""
    cdef int n = 0
    cdef ibv_device **lst = ibv_get_device_list(&n)
    if lst == NULL:
        return []
    try:
        return [ibv_get_device_name(lst[i]).decode() for i in range(n)]
    finally:
        ibv_free_device_list(lst)


# a parent must outlive its children, also when the GC breaks a cycle
@cython.no_gc_clear
cdef class _Resource:
    """Base: an idempotent close(), children closed before their parent."""
    cdef object _children
    cdef object __weakref__

    def __cinit__(self):
        self._children = weakref.WeakSet()

    cdef _adopt(self, _Resource child):
        self._children.add(child)

    def close(self):
        for child in list(self._children):
            child.close()
        self._children.clear()
        self._release()

    cdef _release(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # Each concrete class has its own __dealloc__ calling _release(): Cython
    # runs a subclass's __dealloc__ *before* it clears the subclass's fields,
    # while the parent reference (``self.context``, ``self.pd``) still holds
    # the parent alive.  (Releasing from this base class's __dealloc__ would
    # run after those fields were cleared: a PD freed after its context.)
    # Children hold a reference to their parent, so a parent is only
    # collected after its children.


# a parent must outlive its children, also when the GC breaks a cycle
@cython.no_gc_clear
cdef class Context(_Resource):
    """An opened RDMA device."""
    cdef ibv_context *ctx
    cdef readonly str name

    def __init__(self, str name):
        cdef int n = 0, i
        cdef ibv_device **lst = ibv_get_device_list(&n)
        if lst == NULL:
            _fail("ibv_get_device_list")
        try:
            for i in range(n):
                if ibv_get_device_name(lst[i]).decode() == name:
                    self.ctx = ibv_open_device(lst[i])
                    if self.ctx == NULL:
                        _fail(f"ibv_open_device({name})")
                    global _live_ctx
                    _live_ctx += 1
                    break
            else:
                raise VerbsError(f"no RDMA device named {name!r}")
        finally:
            ibv_free_device_list(lst)
        self.name = name

    @property
    def closed(self):
        return self.ctx == NULL

    cdef _check(self):
        if self.ctx == NULL:
            raise VerbsError(f"device {self.name} is closed")

    def query_device(self):
        cdef ibv_device_attr a
        self._check()
        memset(&a, 0, sizeof(a))
        cdef int rc = ibv_query_device(self.ctx, &a)
        if rc:
            _fail("ibv_query_device", rc)
        return {"fw_ver": a.fw_ver.decode(errors="replace"), "max_mr_size": a.max_mr_size,
                "max_qp_wr": a.max_qp_wr, "max_sge": a.max_sge, "max_cqe": a.max_cqe,
                "max_qp_rd_atom": a.max_qp_rd_atom, "max_qp_init_rd_atom": a.max_qp_init_rd_atom,
                "atomic_cap": a.atomic_cap}

    def query_port(self, int port):
        cdef ibv_port_attr a
        self._check()
        memset(&a, 0, sizeof(a))
        cdef int rc = ibv_query_port(self.ctx, <uint8_t>port, &a)
        if rc:
            _fail(f"ibv_query_port({port})", rc)
        return {"state": a.state, "active": a.state == IBV_PORT_ACTIVE,
                "max_mtu": a.max_mtu, "active_mtu": a.active_mtu,
                "gid_tbl_len": a.gid_tbl_len, "max_msg_sz": a.max_msg_sz, "lid": a.lid,
                "ethernet": a.link_layer == IBV_LINK_LAYER_ETHERNET}

    def query_gid(self, int port, int index):
        """The GID at ``index`` as 16 raw bytes."""
        cdef ibv_gid g
        self._check()
        if ibv_query_gid(self.ctx, <uint8_t>port, index, &g):
            _fail(f"ibv_query_gid({port}, {index})")
        return PyBytes_FromStringAndSize(<char *>g.raw, 16)

    def __dealloc__(self):
        self._release()

    cdef _release(self):
        global _live_ctx
        if self.ctx != NULL:
            ibv_close_device(self.ctx)
            self.ctx = NULL
            _live_ctx -= 1


# a parent must outlive its children, also when the GC breaks a cycle
@cython.no_gc_clear
cdef class PD(_Resource):
    """A protection domain: MRs and QPs of one PD can work together."""
    cdef ibv_pd *pd
    cdef readonly Context context

    def __init__(self, Context context):
        context._check()
        self.pd = ibv_alloc_pd(context.ctx)
        if self.pd == NULL:
            _fail("ibv_alloc_pd")
        global _live_pd
        _live_pd += 1
        self.context = context
        context._adopt(self)

    @property
    def closed(self):
        return self.pd == NULL

    cdef _check(self):
        if self.pd == NULL:
            raise VerbsError("protection domain is closed")

    def __dealloc__(self):
        self._release()

    cdef _release(self):
        global _live_pd
        if self.pd != NULL:
            ibv_dealloc_pd(self.pd)
            self.pd = NULL
            _live_pd -= 1


# a parent must outlive its children, also when the GC breaks a cycle
@cython.no_gc_clear
cdef class MR(_Resource):
    """A memory region over a writable buffer (bytearray, mmap, numpy array).

    The buffer stays exported (so an mmap cannot be closed, a bytearray cannot
    be resized) until ``close()``: the NIC may access it until then."""
    cdef ibv_mr *mr
    cdef Py_buffer view
    cdef bint have_view
    cdef readonly PD pd
    cdef readonly int access

    def __init__(self, PD pd, obj, int access=IBV_ACCESS_LOCAL_WRITE):
        pd._check()
        PyObject_GetBuffer(obj, &self.view, PyBUF_WRITABLE | PyBUF_ANY_CONTIGUOUS)
        self.have_view = True
        if self.view.len == 0:
            self._release()
            raise VerbsError("cannot register an empty buffer")
        self.mr = ibv_reg_mr(pd.pd, self.view.buf, <size_t>self.view.len, access)
        if self.mr == NULL:
            err = errno
            self._release()
            _fail(f"ibv_reg_mr of {self.view.len} bytes", err)
        global _live_mr
        _live_mr += 1
        self.pd = pd
        self.access = access
        pd._adopt(self)

    @property
    def closed(self):
        return self.mr == NULL

    @property
    def addr(self):
        return <uintptr_t>self.view.buf if self.have_view else 0

    @property
    def length(self):
        return self.view.len if self.have_view else 0

    @property
    def lkey(self):
        return self.mr.lkey if self.mr != NULL else 0

    @property
    def rkey(self):
        return self.mr.rkey if self.mr != NULL else 0

    def __dealloc__(self):
        self._release()

    cdef _release(self):
        global _live_mr
        if self.mr != NULL:
            ibv_dereg_mr(self.mr)
            self.mr = NULL
            _live_mr -= 1
        if self.have_view:
            PyBuffer_Release(&self.view)
            self.have_view = False


cdef class MRTable:
    """Registered local memory, searched by address: which lkey covers
    ``[addr, addr+len)``?  (A handful of regions: a linear scan is fastest.)"""
    cdef list _mrs

    def __init__(self):
        self._mrs = []

    def add(self, MR mr):
        self._mrs.append(mr)

    def remove(self, MR mr):
        try:
            self._mrs.remove(mr)
        except ValueError:
            pass

    def __len__(self):
        return len(self._mrs)

    def find(self, obj):
        """The MR that covers the whole of ``obj``'s memory, or None."""
        cdef Py_buffer v
        PyObject_GetBuffer(obj, &v, PyBUF_SIMPLE)
        try:
            return self._find(<uintptr_t>v.buf, <size_t>v.len)
        finally:
            PyBuffer_Release(&v)

    cdef MR _find(self, uintptr_t addr, size_t n):
        cdef MR mr
        for mr in self._mrs:
            if mr.mr != NULL and <uintptr_t>mr.view.buf <= addr and \
                    addr + n <= <uintptr_t>mr.view.buf + <size_t>mr.view.len:
                return mr
        return None


# a parent must outlive its children, also when the GC breaks a cycle
@cython.no_gc_clear
cdef class CQ(_Resource):
    """A completion queue with its own completion channel.

    ``fd`` (non-blocking) becomes readable after ``arm()`` once a completion
    arrives; then ``ack()`` consumes the event(s) and ``arm()`` re-arms --
    *before* draining, so that a completion landing during the drain still
    wakes the loop (the standard ack, re-arm, poll order)."""
    cdef ibv_cq *cq
    cdef ibv_comp_channel *channel
    cdef readonly Context context
    cdef readonly int depth
    cdef unsigned int unacked

    def __init__(self, Context context, int depth=1024):
        context._check()
        self.channel = ibv_create_comp_channel(context.ctx)
        if self.channel == NULL:
            _fail("ibv_create_comp_channel")
        flags = fcntl(self.channel.fd, F_GETFL)
        if flags < 0 or fcntl(self.channel.fd, F_SETFL, flags | O_NONBLOCK) < 0:
            err = errno
            self._release()
            _fail("fcntl(O_NONBLOCK) on the completion channel", err)
        self.cq = ibv_create_cq(context.ctx, depth, NULL, self.channel, 0)
        if self.cq == NULL:
            err = errno
            self._release()
            _fail(f"ibv_create_cq({depth})", err)
        global _live_cq
        _live_cq += 1
        self.context = context
        self.depth = depth
        context._adopt(self)

    @property
    def closed(self):
        return self.cq == NULL

    @property
    def fd(self):
        """The completion channel's fd (for ``loop.add_reader``); -1 once closed."""
        return self.channel.fd if self.channel != NULL else -1

    def arm(self):
        if self.cq == NULL:
            return
        cdef int rc = ibv_req_notify_cq(self.cq, 0)
        if rc:
            _fail("ibv_req_notify_cq", rc)

    def ack(self):
        """Consume every pending channel event; returns how many."""
        cdef ibv_cq *ev_cq
        cdef void *ev_ctx
        cdef int n = 0
        if self.channel == NULL:
            return 0
        while ibv_get_cq_event(self.channel, &ev_cq, &ev_ctx) == 0:
            n += 1
        self.unacked += n
        # acking takes a mutex in libibverbs: batch it
        if self.unacked >= 64:
            ibv_ack_cq_events(self.cq, self.unacked)
            self.unacked = 0
        return n

    def __dealloc__(self):
        self._release()

    cdef _release(self):
        if self.cq != NULL:
            if self.unacked:
                ibv_ack_cq_events(self.cq, self.unacked)
                self.unacked = 0
            ibv_destroy_cq(self.cq)
            self.cq = NULL
            global _live_cq
            _live_cq -= 1
        if self.channel != NULL:
            ibv_destroy_comp_channel(self.channel)
            self.channel = NULL


# a parent must outlive its children, also when the GC breaks a cycle
@cython.no_gc_clear
cdef class QP(_Resource):
    """An RC queue pair (send side only: smb2 posts no receives)."""
    cdef ibv_qp *qp
    cdef readonly PD pd
    cdef readonly CQ cq
    cdef readonly int max_send_wr
    cdef readonly int max_sge
    cdef readonly int port

    def __init__(self, PD pd, CQ cq, int max_send_wr=256, int max_sge=_MAX_SGE):
        cdef ibv_qp_init_attr a
        pd._check()
        if cq.cq == NULL:
            raise VerbsError("completion queue is closed")
        memset(&a, 0, sizeof(a))
        a.send_cq = cq.cq
        a.recv_cq = cq.cq
        a.qp_type = IBV_QPT_RC
        a.sq_sig_all = 0
        a.cap.max_send_wr = max_send_wr
        a.cap.max_recv_wr = 1
        a.cap.max_send_sge = min(max_sge, _MAX_SGE)
        a.cap.max_recv_sge = 1
        self.qp = ibv_create_qp(pd.pd, &a)
        if self.qp == NULL:
            _fail("ibv_create_qp")
        global _live_qp
        _live_qp += 1
        self.pd = pd
        self.cq = cq
        self.max_send_wr = a.cap.max_send_wr
        self.max_sge = min(<int>a.cap.max_send_sge, _MAX_SGE)
        pd._adopt(self)
        cq._adopt(self)

    @property
    def closed(self):
        return self.qp == NULL

    @property
    def qpn(self):
        return self.qp.qp_num if self.qp != NULL else 0

    cdef _check(self):
        if self.qp == NULL:
            raise VerbsError("queue pair is closed")

    def to_init(self, int port, int access=ACCESS_REMOTE_ALL):
        cdef ibv_qp_attr a
        self._check()
        memset(&a, 0, sizeof(a))
        a.qp_state = IBV_QPS_INIT
        a.pkey_index = 0
        a.port_num = <uint8_t>port
        a.qp_access_flags = access
        cdef int rc = ibv_modify_qp(self.qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX |
                                    IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)
        if rc:
            _fail("modify_qp(INIT)", rc)
        self.port = port

    def to_rtr(self, int dest_qpn, int rq_psn, bytes dgid, int sgid_index, int dlid=0,
               int mtu=3, int max_dest_rd_atomic=16):
        """``mtu`` is the verbs enum (1=256 ... 3=1024 ... 5=4096)."""
        cdef ibv_qp_attr a
        self._check()
        if len(dgid) != 16:
            raise ValueError("a GID is 16 bytes")
        memset(&a, 0, sizeof(a))
        a.qp_state = IBV_QPS_RTR
        a.path_mtu = mtu
        a.dest_qp_num = dest_qpn
        a.rq_psn = rq_psn & 0xFFFFFF
        a.max_dest_rd_atomic = <uint8_t>max_dest_rd_atomic
        a.min_rnr_timer = 12
        a.ah_attr.dlid = <uint16_t>dlid
        a.ah_attr.port_num = <uint8_t>self.port
        if sgid_index >= 0:
            a.ah_attr.is_global = 1
            memcpy(a.ah_attr.grh.dgid.raw, <const char *>dgid, 16)
            a.ah_attr.grh.sgid_index = <uint8_t>sgid_index
            a.ah_attr.grh.hop_limit = 64
        cdef int rc = ibv_modify_qp(self.qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                                    IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                    IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)
        if rc:
            _fail("modify_qp(RTR)", rc)

    def to_rts(self, int sq_psn, int timeout=14, int retry_cnt=6, int max_rd_atomic=16):
        """``timeout``: 4.096 us * 2**timeout per try (14: 67 ms; 6 retries:
        a dead peer is reported in about half a second).  Not 7: rdma_rxe
        (like RNR retry counts) treats a retry count of 7 as *infinite*."""
        cdef ibv_qp_attr a
        self._check()
        memset(&a, 0, sizeof(a))
        a.qp_state = IBV_QPS_RTS
        a.sq_psn = sq_psn & 0xFFFFFF
        a.timeout = <uint8_t>timeout
        a.retry_cnt = <uint8_t>retry_cnt
        a.rnr_retry = 7
        a.max_rd_atomic = <uint8_t>max_rd_atomic
        cdef int rc = ibv_modify_qp(self.qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
                                    IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                    IBV_QP_MAX_QP_RD_ATOMIC)
        if rc:
            _fail("modify_qp(RTS)", rc)

    def to_error(self):
        """Flush everything outstanding (each flushed WR completes with an error)."""
        cdef ibv_qp_attr a
        if self.qp == NULL:
            return
        memset(&a, 0, sizeof(a))
        a.qp_state = IBV_QPS_ERR
        ibv_modify_qp(self.qp, &a, IBV_QP_STATE)

    def post_rw(self, int opcode, uint64_t wr_id, list pieces, MRTable table,
                uint64_t remote_addr, uint32_t rkey):
        """Post RDMA READ or WRITE of ``pieces`` (buffer-protocol objects, all
        inside MRs of ``table``) to consecutive remote bytes from
        ``remote_addr``: one work request per ``max_sge`` pieces, chained, only
        the last one signaled (an earlier failure still completes, with this
        ``wr_id``).  Returns the number of work requests, or 0 when a piece is
        not registered (the caller bounces it)."""
        cdef Py_ssize_t n = len(pieces), i, k, nwr
        cdef Py_buffer v
        cdef MR mr
        cdef ibv_sge *sges
        cdef ibv_send_wr *wrs
        cdef ibv_send_wr *bad = NULL
        cdef int flags = PyBUF_WRITABLE if opcode == IBV_WR_RDMA_READ else PyBUF_SIMPLE
        cdef int rc
        self._check()
        if n == 0:
            return 0
        nwr = (n + self.max_sge - 1) // self.max_sge
        sges = <ibv_sge *>malloc(n * sizeof(ibv_sge) + nwr * sizeof(ibv_send_wr))
        if sges == NULL:
            raise MemoryError()
        wrs = <ibv_send_wr *>(sges + n)
        try:
            memset(wrs, 0, nwr * sizeof(ibv_send_wr))
            for i in range(n):
                PyObject_GetBuffer(pieces[i], &v, flags)
                mr = table._find(<uintptr_t>v.buf, <size_t>v.len)
                # The MR keeps the memory pinned; the caller keeps ``pieces``
                # alive until the completion, so the pointer stays valid.
                sges[i].addr = <uintptr_t>v.buf
                sges[i].length = <uint32_t>v.len
                PyBuffer_Release(&v)
                if mr is None:
                    return 0
                sges[i].lkey = mr.mr.lkey
            for k in range(nwr):
                wrs[k].wr_id = wr_id
                wrs[k].next = &wrs[k + 1] if k + 1 < nwr else NULL
                wrs[k].sg_list = &sges[k * self.max_sge]
                wrs[k].num_sge = min(self.max_sge, n - k * self.max_sge)
                wrs[k].opcode = opcode
                wrs[k].send_flags = IBV_SEND_SIGNALED if k + 1 == nwr else 0
                wrs[k].wr.rdma.remote_addr = remote_addr
                wrs[k].wr.rdma.rkey = rkey
                for i in range(k * self.max_sge, k * self.max_sge + wrs[k].num_sge):
                    remote_addr += sges[i].length
            rc = ibv_post_send(self.qp, wrs, &bad)
            if rc:
                _fail("ibv_post_send", rc)
            return nwr
        finally:
            free(sges)

    def post_one(self, int opcode, uint64_t wr_id, uintptr_t laddr, uint32_t length,
                 uint32_t lkey, uint64_t remote_addr, uint32_t rkey):
        """One signaled RDMA READ/WRITE of one local registered range."""
        cdef ibv_sge sge
        cdef ibv_send_wr wr
        cdef ibv_send_wr *bad = NULL
        self._check()
        sge.addr = laddr
        sge.length = length
        sge.lkey = lkey
        memset(&wr, 0, sizeof(wr))
        wr.wr_id = wr_id
        wr.sg_list = &sge
        wr.num_sge = 1
        wr.opcode = opcode
        wr.send_flags = IBV_SEND_SIGNALED
        wr.wr.rdma.remote_addr = remote_addr
        wr.wr.rdma.rkey = rkey
        cdef int rc = ibv_post_send(self.qp, &wr, &bad)
        if rc:
            _fail("ibv_post_send", rc)

    def post_atomic(self, bint cas, uint64_t wr_id, uintptr_t laddr, uint32_t lkey,
                    uint64_t remote_addr, uint32_t rkey, uint64_t compare_add,
                    uint64_t swap=0):
        """FETCH_AND_ADD (``cas`` false) or CMP_AND_SWP; the old value lands
        in the 8 registered bytes at ``laddr``."""
        cdef ibv_sge sge
        cdef ibv_send_wr wr
        cdef ibv_send_wr *bad = NULL
        self._check()
        sge.addr = laddr
        sge.length = 8
        sge.lkey = lkey
        memset(&wr, 0, sizeof(wr))
        wr.wr_id = wr_id
        wr.sg_list = &sge
        wr.num_sge = 1
        wr.opcode = IBV_WR_ATOMIC_CMP_AND_SWP if cas else IBV_WR_ATOMIC_FETCH_AND_ADD
        wr.send_flags = IBV_SEND_SIGNALED
        wr.wr.atomic.remote_addr = remote_addr
        wr.wr.atomic.rkey = rkey
        wr.wr.atomic.compare_add = compare_add
        wr.wr.atomic.swap = swap
        cdef int rc = ibv_post_send(self.qp, &wr, &bad)
        if rc:
            _fail("ibv_post_send", rc)

    def __dealloc__(self):
        self._release()

    cdef _release(self):
        global _live_qp
        if self.qp != NULL:
            ibv_destroy_qp(self.qp)
            self.qp = NULL
            _live_qp -= 1


# a parent must outlive its children, also when the GC breaks a cycle
@cython.no_gc_clear
cdef class Completions:
    """Waiting futures by ``wr_id`` (a slot number), and the CQ drain.

    ``alloc(fut, nwr)`` reserves a slot for an operation of ``nwr`` work
    requests (-1 when none is free or the send queue is full); the drain frees
    it when the operation's signaled completion arrives -- even when the
    future was cancelled meanwhile, because only then has the NIC stopped
    using the operation's memory.  ``on_error(wr_id, status, vendor_err)``
    must return the exception to set (it is called for failed completions
    only).  ``orphaned`` collects the wr_ids whose future was already done
    (cancelled) when their completion came: the transport releases what it
    kept for them.

    An *atomic* slot's future gets the old value of the word as its result:
    it is read from the slot's 8 bytes of the atomic area (``set_atomic_area``)
    during the drain, before the slot can be reused."""
    cdef list _waiters
    cdef int *_nwr
    cdef char *_atomic
    cdef uint64_t *_words
    cdef MR _atomic_mr
    cdef int *_free
    cdef int _nfree
    cdef readonly int slots
    cdef readonly int sq_free
    cdef readonly int sq_depth
    cdef readonly list orphaned
    cdef public object on_error

    def __cinit__(self, int slots, int sq_depth):
        self._nwr = <int *>malloc(slots * sizeof(int))
        self._free = <int *>malloc(slots * sizeof(int))
        self._atomic = <char *>malloc(slots)
        if self._nwr == NULL or self._free == NULL or self._atomic == NULL:
            raise MemoryError()

    def __init__(self, int slots, int sq_depth):
        cdef int i
        self.slots = slots
        self._waiters = [None] * slots
        for i in range(slots):
            self._free[i] = slots - 1 - i
            self._nwr[i] = 0
            self._atomic[i] = 0
        self._nfree = slots
        self.sq_free = sq_depth
        self.sq_depth = sq_depth
        self.orphaned = []
        self.on_error = None

    def __dealloc__(self):
        free(self._nwr)
        free(self._free)
        free(self._atomic)

    def set_atomic_area(self, MR mr):
        """8 registered bytes per slot, where atomics return the old value."""
        if mr.mr == NULL or mr.view.len < self.slots * 8 or (<uintptr_t>mr.view.buf) % 8:
            raise ValueError("the atomic area must be a registered, 8-byte aligned "
                             "region of 8 bytes per slot")
        self._atomic_mr = mr
        self._words = <uint64_t *>mr.view.buf

    def word_addr(self, int slot):
        """Local address of ``slot``'s atomic word."""
        return <uintptr_t>&self._words[slot]

    @property
    def busy(self):
        return self.slots - self._nfree

    def alloc(self, fut, int nwr, bint atomic=False):
        cdef int slot
        if self._nfree == 0 or nwr > self.sq_free:
            return -1
        if atomic and self._words == NULL:
            raise ValueError("no atomic area set")
        self._nfree -= 1
        slot = self._free[self._nfree]
        self._waiters[slot] = fut
        self._nwr[slot] = nwr
        self._atomic[slot] = atomic
        self.sq_free -= nwr
        return slot

    def set_nwr(self, int slot, int nwr):
        """Correct the reservation once the real count is known (it may shrink)."""
        self.sq_free += self._nwr[slot] - nwr
        self._nwr[slot] = nwr

    def cancel(self, int slot):
        """Release a slot whose work request was never posted."""
        self._release(slot)

    cdef inline _release(self, int slot):
        self._waiters[slot] = None
        self.sq_free += self._nwr[slot]
        self._nwr[slot] = 0
        self._free[self._nfree] = slot
        self._nfree += 1

    def drain(self, CQ cq):
        """Poll ``cq`` empty in batches; resolve each completed slot's future
        (result None; an atomic's old value is in its local word).  Returns
        the number of completions."""
        cdef ibv_wc wc[_BATCH]
        cdef int n, i, total = 0
        cdef int slot
        if cq.cq == NULL:
            return 0
        while True:
            n = ibv_poll_cq(cq.cq, _BATCH, wc)
            if n < 0:
                _fail("ibv_poll_cq", -n)
            for i in range(n):
                slot = <int>wc[i].wr_id
                if slot < 0 or slot >= self.slots:
                    continue
                fut = self._waiters[slot]
                if fut is None:
                    # a second completion for one operation: an unsignaled
                    # chained WR that failed (or was flushed) before the last
                    continue
                if fut.done():
                    self.orphaned.append(slot)
                elif wc[i].status != IBV_WC_SUCCESS:
                    # on error every later WR is flushed with its own
                    # completion, so this slot is done with
                    fut.set_exception(self.on_error(slot, wc[i].status, wc[i].vendor_err))
                elif self._atomic[slot]:
                    fut.set_result(self._words[slot])
                else:
                    fut.set_result(None)
                self._release(slot)
            total += n
            if n < _BATCH:
                return total

    def fail_all(self, exc):
        """Fail every waiting future (the QP is gone); frees nothing that the
        NIC could still use -- call only after the QP was destroyed."""
        cdef int slot
        for slot in range(self.slots):
            fut = self._waiters[slot]
            if fut is not None:
                if not fut.done():
                    fut.set_exception(exc)
                self._release(slot)
