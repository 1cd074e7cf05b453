package dayzero

/*
#include <stdlib.h>
#include "dayzero.h"
// Abort callback polled between layers: stops the running call once the Go
// side stores a nonzero value in the flag (C memory, written atomically).
static int dzgo_abort(void *flag) { return __atomic_load_n((int *)flag, __ATOMIC_RELAXED); }
static dz_abort_fn dzgo_abort_fn(void) { return dzgo_abort; }
*/
import "C"

import (
	"context"
	"fmt"
	"runtime"
	"sync/atomic"
	"unsafe"
)

// Sampler is dz_sampler_params. The zero value is greedy decoding.
type Sampler struct {
	Temperature float32 // <= 0: greedy
	TopK        int32   // 0: off
	TopP        float32 // 0 or 1: off
	Seed        uint64
}

func (s Sampler) c() C.dz_sampler_params {
	var p C.dz_sampler_params
	C.dz_sampler_params_init_sized(&p, C.size_t(unsafe.Sizeof(p)))
	p.temperature = C.float(s.Temperature)
	p.top_k = C.int32_t(s.TopK)
	if s.TopP > 0 {
		p.top_p = C.float(s.TopP)
	}
	p.seed = C.uint64_t(s.Seed)
	return p
}

// SessionOptions are dz_session_params; the zero value gives the defaults.
type SessionOptions struct {
	Sampler      Sampler
	PrefillChunk uint32 // tokens per prefill micro-batch, 0 = the library's choice
}

// Session is one sequence drawing pages from an Arena. Use it from one
// goroutine at a time.
type Session struct {
	p        *C.dz_session
	arena    *Arena
	ownArena bool
	abort    *abortFlag
}

// abortFlag is the C int the abort callback polls, shared by a session and
// its forks (a fork keeps its parent's callback), freed with the last of them.
type abortFlag struct {
	p    *C.int
	refs int32
}

func newAbortFlag() *abortFlag {
	return &abortFlag{p: (*C.int)(C.calloc(1, C.size_t(unsafe.Sizeof(C.int(0))))), refs: 1}
}

func (f *abortFlag) ref() *abortFlag { atomic.AddInt32(&f.refs, 1); return f }

func (f *abortFlag) unref() {
	if atomic.AddInt32(&f.refs, -1) == 0 {
		C.free(unsafe.Pointer(f.p))
		f.p = nil
	}
}

func (f *abortFlag) set(v int32) { atomic.StoreInt32((*int32)(unsafe.Pointer(f.p)), v) }

// NewSession creates an empty session in the arena; opts may be nil.
func (a *Arena) NewSession(opts *SessionOptions) (*Session, error) {
	defer runtime.KeepAlive(a) // the finalizer must not free it during a C call
	var p C.dz_session_params
	C.dz_session_params_init_sized(&p, C.size_t(unsafe.Sizeof(p)))
	if opts != nil {
		p.sampler = opts.Sampler.c()
		p.prefill_chunk = C.uint32_t(opts.PrefillChunk)
	}
	if a.p == nil {
		return nil, errClosed
	}
	s := &Session{arena: a, abort: newAbortFlag()}
	p.abort = C.dzgo_abort_fn()
	p.abort_user = unsafe.Pointer(s.abort.p)
	if err := call(func() C.dz_status { return C.dz_session_create(a.p, &p, &s.p) }); err != nil {
		s.abort.unref()
		return nil, err
	}
	s.adopt()
	return s, nil
}

func (s *Session) adopt() {
	atomic.AddInt32(&s.arena.deps, 1)
	runtime.SetFinalizer(s, func(s *Session) { s.Close() })
}

// NewSession creates a session with its own default arena, closed with it.
func (m *Model) NewSession(opts *SessionOptions) (*Session, error) {
	defer runtime.KeepAlive(m) // the finalizer must not free it during a C call
	a, err := m.NewArena(nil)
	if err != nil {
		return nil, err
	}
	s, err := a.NewSession(opts)
	if err != nil {
		a.Close()
		return nil, err
	}
	s.ownArena = true
	return s, nil
}

// Close frees the session (and its arena when Model.NewSession made it).
func (s *Session) Close() error {
	if s.p == nil {
		return nil
	}
	C.dz_session_free(s.p)
	s.p = nil
	s.abort.unref()
	s.abort = nil
	atomic.AddInt32(&s.arena.deps, -1)
	runtime.SetFinalizer(s, nil)
	if s.ownArena {
		return s.arena.Close()
	}
	return nil
}

func (s *Session) ptr() (*C.dz_session, error) {
	if s.p == nil {
		return nil, errClosed
	}
	return s.p, nil
}

// Fork returns a copy sharing this session's pages copy-on-write.
func (s *Session) Fork() (*Session, error) {
	defer runtime.KeepAlive(s) // the finalizer must not free it during a C call
	p, err := s.ptr()
	if err != nil {
		return nil, err
	}
	f := &Session{arena: s.arena}
	if err := call(func() C.dz_status { return C.dz_session_fork(p, &f.p) }); err != nil {
		return nil, err
	}
	f.abort = s.abort.ref()
	f.adopt()
	return f, nil
}

// LogitsMode selects which appended tokens get logits.
type LogitsMode int

const (
	LogitsLast LogitsMode = C.DZ_LOGITS_LAST
	LogitsAll  LogitsMode = C.DZ_LOGITS_ALL
)

func ids(tokens []int32) *C.int32_t {
	if len(tokens) == 0 {
		return nil
	}
	return (*C.int32_t)(unsafe.Pointer(&tokens[0]))
}

// Append runs the model over tokens (chunked prefill). On failure the
// session is unchanged.
func (s *Session) Append(tokens []int32, mode LogitsMode) error {
	defer runtime.KeepAlive(s) // the finalizer must not free it during a C call
	p, err := s.ptr()
	if err != nil {
		return err
	}
	return call(func() C.dz_status {
		return C.dz_session_append(p, ids(tokens), C.size_t(len(tokens)), C.dz_logits_mode(mode))
	})
}

// Logits is a copy of the last append's logits, Rows x Vocab, row-major.
type Logits struct {
	Rows, Vocab int
	Data        []float32
}

// Row returns row i.
func (l Logits) Row(i int) []float32 { return l.Data[i*l.Vocab : (i+1)*l.Vocab] }

// Logits copies the last append's logits.
func (s *Session) Logits() (Logits, error) {
	defer runtime.KeepAlive(s) // the finalizer must not free it during a C call
	p, err := s.ptr()
	if err != nil {
		return Logits{}, err
	}
	var data *C.float
	var rows, nv C.size_t
	if err := call(func() C.dz_status { return C.dz_session_logits(p, &data, &rows, &nv) }); err != nil {
		return Logits{}, err
	}
	n := int(rows) * int(nv)
	out := Logits{Rows: int(rows), Vocab: int(nv), Data: make([]float32, n)}
	if n > 0 {
		copy(out.Data, unsafe.Slice((*float32)(unsafe.Pointer(data)), n))
	}
	return out, nil
}

// Sample draws the next id from the last logits row without appending it.
func (s *Session) Sample() (int32, error) {
	defer runtime.KeepAlive(s) // the finalizer must not free it during a C call
	p, err := s.ptr()
	if err != nil {
		return 0, err
	}
	var t C.int32_t
	err = call(func() C.dz_status { return C.dz_session_sample(p, &t) })
	return int32(t), err
}

// SetSampler replaces the session's sampler settings.
func (s *Session) SetSampler(sm Sampler) error {
	defer runtime.KeepAlive(s) // the finalizer must not free it during a C call
	p, err := s.ptr()
	if err != nil {
		return err
	}
	cp := sm.c()
	return call(func() C.dz_status { return C.dz_session_set_sampler(p, &cp) })
}

// Len is the number of tokens in the sequence.
func (s *Session) Len() (int, error) {
	defer runtime.KeepAlive(s) // the finalizer must not free it during a C call
	p, err := s.ptr()
	if err != nil {
		return 0, err
	}
	var n C.size_t
	err = call(func() C.dz_status { return C.dz_session_length(p, &n) })
	return int(n), err
}

// Truncate keeps the first n tokens.
func (s *Session) Truncate(n int) error {
	defer runtime.KeepAlive(s) // the finalizer must not free it during a C call
	p, err := s.ptr()
	if err != nil {
		return err
	}
	if n < 0 {
		return &Error{ErrInvalidArgument, fmt.Sprintf("Truncate: n is %d", n)}
	}
	return call(func() C.dz_status { return C.dz_session_truncate(p, C.size_t(n)) })
}

// Reset truncates to 0.
func (s *Session) Reset() error {
	defer runtime.KeepAlive(s) // the finalizer must not free it during a C call
	p, err := s.ptr()
	if err != nil {
		return err
	}
	return call(func() C.dz_status { return C.dz_session_reset(p) })
}

// SessionStats is dz_session_stats.
type SessionStats struct {
	Tokens, TokensComputed, TokensReused, Pages, AttentionTokensRead uint64
}

// Stats reports the session's counters.
func (s *Session) Stats() (SessionStats, error) {
	defer runtime.KeepAlive(s) // the finalizer must not free it during a C call
	p, err := s.ptr()
	if err != nil {
		return SessionStats{}, err
	}
	var st C.dz_session_stats
	C.dz_session_stats_init_sized(&st, C.size_t(unsafe.Sizeof(st)))
	if err := call(func() C.dz_status { return C.dz_session_get_stats(p, &st) }); err != nil {
		return SessionStats{}, err
	}
	return SessionStats{uint64(st.n_tokens), uint64(st.tokens_computed), uint64(st.tokens_reused),
		uint64(st.pages), uint64(st.attention_tokens_read)}, nil
}

func sessionPtrs(sessions []*Session) ([]*C.dz_session, error) {
	ps := make([]*C.dz_session, len(sessions))
	for i, s := range sessions {
		p, err := s.ptr()
		if err != nil {
			return nil, err
		}
		ps[i] = p
	}
	return ps, nil
}

// GenerateStep advances sessions of one arena by one token each (continuous
// batching): each samples its next id, appends it and computes its logits.
func GenerateStep(sessions []*Session) ([]int32, error) {
	ps, err := sessionPtrs(sessions)
	if err != nil || len(ps) == 0 {
		return nil, err
	}
	defer runtime.KeepAlive(sessions)
	out := make([]int32, len(ps))
	err = call(func() C.dz_status {
		return C.dz_generate_step((**C.dz_session)(unsafe.Pointer(&ps[0])), C.size_t(len(ps)), ids(out))
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// DecodeBatch appends tokens[i] to sessions[i], batched (forced decoding).
func DecodeBatch(sessions []*Session, tokens []int32) error {
	if len(sessions) != len(tokens) {
		return &Error{ErrInvalidArgument, fmt.Sprintf("DecodeBatch: %d sessions, %d tokens", len(sessions), len(tokens))}
	}
	ps, err := sessionPtrs(sessions)
	if err != nil || len(ps) == 0 {
		return err
	}
	defer runtime.KeepAlive(sessions)
	return call(func() C.dz_status {
		return C.dz_decode_batch((**C.dz_session)(unsafe.Pointer(&ps[0])), ids(tokens), C.size_t(len(ps)))
	})
}

// Step samples the next id, appends it and computes its logits.
func (s *Session) Step() (int32, error) {
	defer runtime.KeepAlive(s) // the finalizer must not free it during a C call
	out, err := GenerateStep([]*Session{s})
	if err != nil {
		return 0, err
	}
	return out[0], nil
}

// Token is one generated token: its id and, when the model has a tokenizer,
// the text it completes (possibly "" while a UTF-8 character is incomplete).
type Token struct {
	ID   int32
	Text string
}

// GenerateOptions bound a generation.
type GenerateOptions struct {
	MaxTokens int     // default 256
	Stop      []int32 // ids that end generation; nil: the tokenizer's stop ids
}

// Generate appends prompt, then produces up to MaxTokens tokens, calling fn
// for each as soon as it exists (streaming). A stop id ends generation
// without being passed to fn; an error from fn ends it and is returned.
// Cancelling ctx stops a running forward pass between layers (the error is
// then ErrCancelled, or ctx's error between tokens).
func (s *Session) Generate(ctx context.Context, prompt []int32, opts GenerateOptions, fn func(Token) error) error {
	defer runtime.KeepAlive(s) // the finalizer must not free it during a C call
	if _, err := s.ptr(); err != nil {
		return err
	}
	max := opts.MaxTokens
	if max == 0 {
		max = 256
	}
	tok, err := s.arena.model.Tokenizer()
	if err != nil {
		return err
	}
	stop := map[int32]bool{}
	if opts.Stop != nil {
		for _, id := range opts.Stop {
			stop[id] = true
		}
	} else if tok != nil {
		ids, err := tok.StopIDs()
		if err != nil {
			return err
		}
		for _, id := range ids {
			stop[id] = true
		}
	}
	var detok *Detokenizer
	if tok != nil {
		if detok, err = tok.NewDetokenizer(); err != nil {
			return err
		}
		defer detok.Close()
	}
	// Cancellation: a watcher sets the flag the C abort callback polls.
	flag := s.abort
	flag.set(0)
	done, exited := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		select {
		case <-ctx.Done():
			flag.set(1)
		case <-done:
		}
	}()
	defer func() { close(done); <-exited; flag.set(0) }()
	if len(prompt) > 0 {
		if err := s.Append(prompt, LogitsLast); err != nil {
			return err
		}
	}
	for i := 0; i < max; i++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		id, err := s.Step()
		if err != nil {
			return err
		}
		if stop[id] {
			return nil
		}
		t := Token{ID: id}
		if detok != nil {
			if t.Text, err = detok.Push(id); err != nil {
				return err
			}
		}
		if err := fn(t); err != nil {
			return err
		}
	}
	return nil
}
