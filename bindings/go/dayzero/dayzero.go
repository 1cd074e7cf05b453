// Package dayzero binds libdayzero's C API (dayzero.h) through cgo.
//
// Handles (Model, Tokenizer, Detokenizer, Arena, Session) are freed by their
// Close methods; a finalizer frees a handle that was never closed, as a
// safety net only. Close a handle's dependants first: sessions before their
// arena, arenas before their model (Close reports an error otherwise).
//
// Thread safety follows the C API: a Model and a Tokenizer may be used from
// any goroutine concurrently, an Arena is internally synchronised, and a
// Session or Detokenizer must be used by one goroutine at a time.
package dayzero

/*
#cgo pkg-config: dayzero
#include <stdlib.h>
#include "dayzero.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"
)

// ABIVersion is the DZ_ABI_VERSION this package was compiled against.
const ABIVersion = int(C.DZ_ABI_VERSION)

// Version returns the loaded library's "MAJOR.MINOR.PATCH".
func Version() string { return C.GoString(C.dz_version()) }

// LibraryABIVersion returns the loaded library's ABI version.
func LibraryABIVersion() int { return int(C.dz_abi_version()) }

// Status is a dz_status. Every non-OK status is also an error value, so
// errors.Is(err, dayzero.ErrIO) tests the status of an *Error.
type Status int

// The dz_status values.
const (
	OK                 Status = C.DZ_OK
	ErrInvalidArgument Status = C.DZ_ERR_INVALID_ARGUMENT
	ErrIO              Status = C.DZ_ERR_IO
	ErrFormat          Status = C.DZ_ERR_FORMAT
	ErrUnsupported     Status = C.DZ_ERR_UNSUPPORTED
	ErrOutOfMemory     Status = C.DZ_ERR_OUT_OF_MEMORY
	ErrKVFull          Status = C.DZ_ERR_KV_FULL
	ErrCancelled       Status = C.DZ_ERR_CANCELLED
	ErrDevice          Status = C.DZ_ERR_DEVICE
	ErrNotFound        Status = C.DZ_ERR_NOT_FOUND
	ErrBufferTooSmall  Status = C.DZ_ERR_BUFFER_TOO_SMALL
	ErrInternal        Status = C.DZ_ERR_INTERNAL
)

// String is the C name of the status ("DZ_ERR_IO").
func (s Status) String() string { return C.GoString(C.dz_status_name(C.dz_status(s))) }
func (s Status) Error() string  { return s.String() }

// Error is a failing call: its status and the library's message (dz_last_error).
type Error struct {
	Status  Status
	Message string
}

func (e *Error) Error() string { return e.Status.String() + ": " + e.Message }
func (e *Error) Unwrap() error { return e.Status }

// call runs one C call and reads its thread-local message on the same OS thread.
func call(f func() C.dz_status) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if st := f(); st != C.DZ_OK {
		return &Error{Status(st), C.GoString(C.dz_last_error())}
	}
	return nil
}

var errClosed = errors.New("dayzero: handle is closed")

// Device selects the backend.
type Device int

const (
	DeviceCPU  Device = C.DZ_DEVICE_CPU
	DeviceCUDA Device = C.DZ_DEVICE_CUDA
	DeviceAuto Device = C.DZ_DEVICE_AUTO
)

// Experts selects the MoE expert precision.
type Experts int

const (
	ExpertsAuto   Experts = C.DZ_EXPERTS_AUTO
	ExpertsNative Experts = C.DZ_EXPERTS_NATIVE
	ExpertsFP8    Experts = C.DZ_EXPERTS_FP8
	ExpertsBF16   Experts = C.DZ_EXPERTS_BF16
)

// Indexer selects the sparse-attention indexer's precision. Its zero value is
// the backend's own (CPU exact, CUDA FP8), so the values differ from C's.
type Indexer int

const (
	IndexerAuto Indexer = iota
	IndexerExact
	IndexerFP8
)

// ModelOptions are dz_model_params; the zero value gives the library's defaults.
type ModelOptions struct {
	Device      Device
	DeviceIndex int
	Threads     int // CPU threads, 0 = all cores
	Experts     Experts
	Indexer     Indexer
	// NoBF16Sensitive turns off BF16 for router, lm_head and attention on CUDA.
	NoBF16Sensitive bool
}

// Model is an opened model directory. Immutable; safe for concurrent use.
type Model struct {
	p    *C.dz_model
	mu   sync.Mutex // dz_kv_arena_create takes the model non-const: serialise it
	deps int32      // open arenas
	tok  *Tokenizer
	Path string
}

// OpenModel opens a Hugging Face model directory; opts may be nil.
func OpenModel(dir string, opts *ModelOptions) (*Model, error) {
	var p C.dz_model_params
	// cgo cannot call the header's dz_*_init(p) macros: the *_init_sized forms
	// they stand for are given this package's own struct size, so a newer
	// library never writes past the struct compiled in here.
	C.dz_model_params_init_sized(&p, C.size_t(unsafe.Sizeof(p)))
	if opts != nil {
		p.device = C.dz_device(opts.Device)
		p.device_index = C.int(opts.DeviceIndex)
		p.n_threads = C.int(opts.Threads)
		p.experts = C.dz_expert_precision(opts.Experts)
		switch opts.Indexer {
		case IndexerExact:
			p.indexer = C.DZ_INDEXER_EXACT
		case IndexerFP8:
			p.indexer = C.DZ_INDEXER_FP8
		default:
			p.indexer = C.DZ_INDEXER_AUTO
		}
		if opts.NoBF16Sensitive {
			p.bf16_sensitive = 0
		}
	}
	cdir := C.CString(dir)
	defer C.free(unsafe.Pointer(cdir))
	m := &Model{Path: dir}
	if err := call(func() C.dz_status { return C.dz_model_open(cdir, &p, &m.p) }); err != nil {
		return nil, err
	}
	runtime.SetFinalizer(m, func(m *Model) { m.Close() })
	return m, nil
}

// Close frees the model. It fails while arenas made from it are open.
func (m *Model) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.p == nil {
		return nil
	}
	if n := atomic.LoadInt32(&m.deps); n > 0 {
		return fmt.Errorf("dayzero: model %s still has %d open arena(s); close them first", m.Path, n)
	}
	if m.tok != nil {
		m.tok.p = nil
	}
	C.dz_model_free(m.p)
	m.p = nil
	runtime.SetFinalizer(m, nil)
	return nil
}

// ModelInfo is dz_model_info.
type ModelInfo struct {
	Architecture                          string
	Device                                Device
	Layers, Vocab, Hidden, Heads, KVHeads int
	Experts, ExpertsActive, Shards        int
	MaxContext                            int64
	Params, WeightBytes, DeviceBytes      uint64
}

// Info describes the model.
func (m *Model) Info() (ModelInfo, error) {
	defer runtime.KeepAlive(m) // the finalizer must not free it during a C call
	if m.p == nil {
		return ModelInfo{}, errClosed
	}
	var i C.dz_model_info
	C.dz_model_info_init_sized(&i, C.size_t(unsafe.Sizeof(i)))
	if err := call(func() C.dz_status { return C.dz_model_get_info(m.p, &i) }); err != nil {
		return ModelInfo{}, err
	}
	return ModelInfo{
		Architecture: C.GoString(i.architecture), Device: Device(i.device),
		Layers: int(i.n_layers), Vocab: int(i.n_vocab), Hidden: int(i.hidden_size), Heads: int(i.n_heads),
		KVHeads: int(i.n_kv_heads), Experts: int(i.n_experts), ExpertsActive: int(i.n_experts_active),
		Shards: int(i.n_shards), MaxContext: int64(i.max_context), Params: uint64(i.n_params),
		WeightBytes: uint64(i.weight_bytes), DeviceBytes: uint64(i.device_bytes),
	}, nil
}

// Tokenizer returns the model's tokenizer (owned by the model), or nil and no
// error when the model directory has none.
func (m *Model) Tokenizer() (*Tokenizer, error) {
	defer runtime.KeepAlive(m) // the finalizer must not free it during a C call
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.p == nil {
		return nil, errClosed
	}
	if m.tok != nil {
		return m.tok, nil
	}
	var t *C.dz_tokenizer
	err := call(func() C.dz_status { return C.dz_model_tokenizer(m.p, &t) })
	if errors.Is(err, ErrNotFound) || errors.Is(err, ErrUnsupported) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	m.tok = &Tokenizer{p: t, owner: m}
	return m.tok, nil
}

// ArenaOptions are dz_kv_arena_params; the zero value gives the defaults.
type ArenaOptions struct {
	PageTokens    uint32
	CapacityPages uint64
	CapacityBytes uint64
	MaxSessions   uint32
	NoPrefixCache bool
}

// Arena is a paged KV pool. Internally synchronised.
type Arena struct {
	p     *C.dz_kv_arena
	model *Model
	deps  int32 // open sessions
	mu    sync.Mutex
}

// NewArena creates a KV arena for the model; opts may be nil.
func (m *Model) NewArena(opts *ArenaOptions) (*Arena, error) {
	defer runtime.KeepAlive(m) // the finalizer must not free it during a C call
	var p C.dz_kv_arena_params
	C.dz_kv_arena_params_init_sized(&p, C.size_t(unsafe.Sizeof(p)))
	if opts != nil {
		p.page_tokens = C.uint32_t(opts.PageTokens)
		p.capacity_pages = C.uint64_t(opts.CapacityPages)
		p.capacity_bytes = C.uint64_t(opts.CapacityBytes)
		p.max_sessions = C.uint32_t(opts.MaxSessions)
		if opts.NoPrefixCache {
			p.prefix_cache = 0
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.p == nil {
		return nil, errClosed
	}
	a := &Arena{model: m}
	if err := call(func() C.dz_status { return C.dz_kv_arena_create(m.p, &p, &a.p) }); err != nil {
		return nil, err
	}
	atomic.AddInt32(&m.deps, 1)
	runtime.SetFinalizer(a, func(a *Arena) { a.Close() })
	return a, nil
}

// Close frees the arena. It fails while sessions drawing from it are open.
func (a *Arena) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.p == nil {
		return nil
	}
	if n := atomic.LoadInt32(&a.deps); n > 0 {
		return fmt.Errorf("dayzero: arena still has %d open session(s); close them first", n)
	}
	C.dz_kv_arena_free(a.p)
	a.p = nil
	atomic.AddInt32(&a.model.deps, -1)
	runtime.SetFinalizer(a, nil)
	return nil
}

// ArenaStats is dz_kv_stats.
type ArenaStats struct {
	PageTokens                                               uint32
	PageBytes, PagesTotal, PagesUsed, PagesCached, PagesFree uint64
	BytesTotal, BytesMetadata, TokensRequested, TokensReused uint64
	Evictions                                                uint64
	StateSlotsTotal, StateSlotsUsed                          uint32
	StateBytes                                               uint64 // one session's recurrent state
	StateSnapshotsTotal, StateSnapshotsUsed                  uint32
}

// Stats reports the arena's pages, bytes and prefix-cache use.
func (a *Arena) Stats() (ArenaStats, error) {
	defer runtime.KeepAlive(a) // the finalizer must not free it during a C call
	if a.p == nil {
		return ArenaStats{}, errClosed
	}
	var s C.dz_kv_stats
	C.dz_kv_stats_init_sized(&s, C.size_t(unsafe.Sizeof(s)))
	if err := call(func() C.dz_status { return C.dz_kv_arena_get_stats(a.p, &s) }); err != nil {
		return ArenaStats{}, err
	}
	return ArenaStats{uint32(s.page_tokens), uint64(s.page_bytes), uint64(s.pages_total), uint64(s.pages_used),
		uint64(s.pages_cached), uint64(s.pages_free), uint64(s.bytes_total), uint64(s.bytes_metadata),
		uint64(s.tokens_requested), uint64(s.tokens_reused), uint64(s.evictions), uint32(s.state_slots_total),
		uint32(s.state_slots_used), uint64(s.state_bytes), uint32(s.state_snapshots_total),
		uint32(s.state_snapshots_used)}, nil
}
