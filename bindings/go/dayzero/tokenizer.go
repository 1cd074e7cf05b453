package dayzero

/*
#include <stdlib.h>
#include "dayzero.h"
*/
import "C"

import (
	"errors"
	"runtime"
	"unsafe"
)

// Tokenizer encodes and decodes text. Safe for concurrent use.
type Tokenizer struct {
	p     *C.dz_tokenizer
	owner *Model // non-nil: the model's tokenizer, freed with the model
}

// OpenTokenizer opens a tokenizer.json (tokenizer_config.json beside it is
// read when present) or a tiktoken.model.
func OpenTokenizer(path string) (*Tokenizer, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	t := &Tokenizer{}
	if err := call(func() C.dz_status { return C.dz_tokenizer_open(cpath, &t.p) }); err != nil {
		return nil, err
	}
	runtime.SetFinalizer(t, func(t *Tokenizer) { t.Close() })
	return t, nil
}

// Close frees a tokenizer from OpenTokenizer; the model's own is left alone.
func (t *Tokenizer) Close() error {
	if t.owner == nil && t.p != nil {
		C.dz_tokenizer_free(t.p)
		runtime.SetFinalizer(t, nil)
	}
	t.p = nil
	return nil
}

func (t *Tokenizer) ptr() (*C.dz_tokenizer, error) {
	if t.p == nil {
		return nil, errClosed
	}
	return t.p, nil
}

// Encode tokenizes UTF-8 text; parseSpecial turns special-token text into its id.
func (t *Tokenizer) Encode(text string, parseSpecial bool) ([]int32, error) {
	defer runtime.KeepAlive(t) // the finalizer must not free it during a C call
	p, err := t.ptr()
	if err != nil {
		return nil, err
	}
	ctext := C.CString(text)
	defer C.free(unsafe.Pointer(ctext))
	special := C.int(0)
	if parseSpecial {
		special = 1
	}
	out := make([]int32, len(text)+8)
	for {
		var n C.size_t
		err = call(func() C.dz_status {
			return C.dz_tokenize(p, ctext, C.size_t(len(text)), special, ids(out), C.size_t(len(out)), &n)
		})
		if errors.Is(err, ErrBufferTooSmall) && int(n) > len(out) {
			out = make([]int32, int(n))
			continue
		}
		if err != nil {
			return nil, err
		}
		return out[:n], nil
	}
}

// bytesCall runs a C call that writes UTF-8 into (out, cap, n_out), growing the buffer as asked.
func bytesCall(f func(out *C.char, cap C.size_t, n *C.size_t) C.dz_status) (string, error) {
	buf := make([]byte, 256)
	for {
		var n C.size_t
		err := call(func() C.dz_status { return f((*C.char)(unsafe.Pointer(&buf[0])), C.size_t(len(buf)), &n) })
		if errors.Is(err, ErrBufferTooSmall) && int(n) > len(buf) {
			buf = make([]byte, int(n))
			continue
		}
		if err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	}
}

// Decode turns ids into text.
func (t *Tokenizer) Decode(tokens []int32) (string, error) {
	defer runtime.KeepAlive(t) // the finalizer must not free it during a C call
	p, err := t.ptr()
	if err != nil {
		return "", err
	}
	return bytesCall(func(out *C.char, cap C.size_t, n *C.size_t) C.dz_status {
		return C.dz_detokenize(p, ids(tokens), C.size_t(len(tokens)), out, cap, n)
	})
}

// ApplyChatTemplate renders messagesJSON (a JSON array of {"role","content"}
// objects) through the chat template; optionsJSON is "" or a JSON object of
// extra template variables.
func (t *Tokenizer) ApplyChatTemplate(messagesJSON, optionsJSON string, addGenerationPrompt bool) (string, error) {
	defer runtime.KeepAlive(t) // the finalizer must not free it during a C call
	p, err := t.ptr()
	if err != nil {
		return "", err
	}
	cm := C.CString(messagesJSON)
	defer C.free(unsafe.Pointer(cm))
	var co *C.char
	if optionsJSON != "" {
		co = C.CString(optionsJSON)
		defer C.free(unsafe.Pointer(co))
	}
	gen := C.int(0)
	if addGenerationPrompt {
		gen = 1
	}
	return bytesCall(func(out *C.char, cap C.size_t, n *C.size_t) C.dz_status {
		return C.dz_chat_apply_template(p, cm, co, gen, out, cap, n)
	})
}

// VocabSize is the number of token ids.
func (t *Tokenizer) VocabSize() (int, error) {
	defer runtime.KeepAlive(t) // the finalizer must not free it during a C call
	p, err := t.ptr()
	if err != nil {
		return 0, err
	}
	var n C.int32_t
	err = call(func() C.dz_status { return C.dz_tokenizer_vocab_size(p, &n) })
	return int(n), err
}

// TokenID is the id of a token's exact text (ErrNotFound when there is none).
func (t *Tokenizer) TokenID(text string) (int32, error) {
	defer runtime.KeepAlive(t) // the finalizer must not free it during a C call
	p, err := t.ptr()
	if err != nil {
		return 0, err
	}
	ctext := C.CString(text)
	defer C.free(unsafe.Pointer(ctext))
	var id C.int32_t
	err = call(func() C.dz_status { return C.dz_tokenizer_token_id(p, ctext, &id) })
	return int32(id), err
}

// StopIDs are the ids that end generation.
func (t *Tokenizer) StopIDs() ([]int32, error) {
	defer runtime.KeepAlive(t) // the finalizer must not free it during a C call
	p, err := t.ptr()
	if err != nil {
		return nil, err
	}
	var data *C.int32_t
	var n C.size_t
	if err := call(func() C.dz_status { return C.dz_tokenizer_stop_ids(p, &data, &n) }); err != nil {
		return nil, err
	}
	out := make([]int32, int(n))
	if n > 0 {
		copy(out, unsafe.Slice((*int32)(unsafe.Pointer(data)), int(n)))
	}
	return out, nil
}

// Detokenizer decodes a stream of ids; every piece is valid UTF-8. Use it
// from one goroutine at a time.
type Detokenizer struct {
	p   *C.dz_detokenizer
	tok *Tokenizer
}

// NewDetokenizer creates a streaming decoder.
func (t *Tokenizer) NewDetokenizer() (*Detokenizer, error) {
	defer runtime.KeepAlive(t) // the finalizer must not free it during a C call
	p, err := t.ptr()
	if err != nil {
		return nil, err
	}
	d := &Detokenizer{tok: t}
	if err := call(func() C.dz_status { return C.dz_detokenizer_create(p, &d.p) }); err != nil {
		return nil, err
	}
	runtime.SetFinalizer(d, func(d *Detokenizer) { d.Close() })
	return d, nil
}

// Push feeds one id and returns the text now complete (possibly "").
func (d *Detokenizer) Push(id int32) (string, error) {
	defer runtime.KeepAlive(d) // the finalizer must not free it during a C call
	if d.p == nil {
		return "", errClosed
	}
	var piece *C.char
	var n C.size_t
	if err := call(func() C.dz_status { return C.dz_detokenizer_push(d.p, C.int32_t(id), &piece, &n) }); err != nil {
		return "", err
	}
	return C.GoStringN(piece, C.int(n)), nil
}

// Flush ends the stream: it returns what Push held back (an incomplete UTF-8
// sequence as U+FFFD).
func (d *Detokenizer) Flush() (string, error) {
	defer runtime.KeepAlive(d)
	if d.p == nil {
		return "", errClosed
	}
	var piece *C.char
	var n C.size_t
	if err := call(func() C.dz_status { return C.dz_detokenizer_flush(d.p, &piece, &n) }); err != nil {
		return "", err
	}
	return C.GoStringN(piece, C.int(n)), nil
}

// Close frees the detokenizer.
func (d *Detokenizer) Close() error {
	if d.p != nil {
		C.dz_detokenizer_free(d.p)
		d.p = nil
		runtime.SetFinalizer(d, nil)
	}
	return nil
}
