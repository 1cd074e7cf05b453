package dayzero_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"

	"dayzero"
)

var prompt = []int32{2, 17, 300, 45, 8, 99}

const nGen = 8

// small is a small KV arena: quick to set up.
var small = &dayzero.ArenaOptions{CapacityBytes: 8 << 20}

func newSession(t *testing.T, m *dayzero.Model) *dayzero.Session {
	t.Helper()
	a, err := m.NewArena(small)
	if err != nil {
		t.Fatal(err)
	}
	s, err := a.NewSession(nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.Close()
		a.Close()
	})
	return s
}

func env(t *testing.T, name string) string {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		t.Fatalf("%s is not set (ctest sets it; see tests/bindings.cmake)", name)
	}
	return v
}

type refKey struct {
	model, prompt string
	n             int
}

type refResult struct {
	ids  []int32
	text []byte // nil without a tokenizer
	err  string
}

var (
	refMu    sync.Mutex
	refCache = map[refKey]refResult{}
)

// reference runs the C example program (the C API) on prompt, once per
// input: every process loading libdayzero costs start-up time.
func reference(t *testing.T, model string, prompt []int32, n int) ([]int32, []byte) {
	t.Helper()
	refMu.Lock()
	defer refMu.Unlock()
	key := refKey{model, fmt.Sprint(prompt), n}
	r, ok := refCache[key]
	if !ok {
		r = runReference(env(t, "DAYZERO_TEST_REFERENCE"), model, prompt, n)
		refCache[key] = r
	}
	if r.err != "" {
		t.Fatal(r.err)
	}
	return r.ids, r.text
}

func referenceIDs(t *testing.T) []int32 {
	ids, _ := reference(t, env(t, "DAYZERO_TEST_MODEL"), prompt, nGen)
	return ids
}

func runReference(ref, model string, prompt []int32, n int) refResult {
	args := []string{model, strconv.Itoa(n)}
	for _, id := range prompt {
		args = append(args, strconv.Itoa(int(id)))
	}
	out, err := exec.Command(ref, args...).Output()
	if err != nil {
		return refResult{err: fmt.Sprintf("reference program failed: %v\n%s", err, out)}
	}
	var r refResult
	// "text: " is the last line; the text itself may hold newlines.
	if i := bytes.Index(out, []byte("\ntext: ")); i >= 0 {
		r.text = out[i+len("\ntext: ") : len(out)-1]
	}
	for _, line := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(line, "generated:") {
			for _, f := range strings.Fields(strings.TrimPrefix(line, "generated:")) {
				v, err := strconv.Atoi(f)
				if err != nil {
					return refResult{err: err.Error()}
				}
				r.ids = append(r.ids, int32(v))
			}
			if len(r.ids) != n {
				return refResult{err: fmt.Sprintf("reference gave %d ids: %s", len(r.ids), out)}
			}
			return r
		}
	}
	return refResult{err: fmt.Sprintf("no 'generated:' line in the reference output:\n%s", out)}
}

func TestVersionMatchesHeader(t *testing.T) {
	h, err := os.ReadFile(env(t, "DAYZERO_TEST_HEADER"))
	if err != nil {
		t.Fatal(err)
	}
	var parts []string
	for _, k := range []string{"MAJOR", "MINOR", "PATCH"} {
		m := regexp.MustCompile(`#define DZ_VERSION_` + k + ` (\d+)`).FindSubmatch(h)
		if m == nil {
			t.Fatalf("DZ_VERSION_%s not in the header", k)
		}
		parts = append(parts, string(m[1]))
	}
	if got, want := dayzero.Version(), strings.Join(parts, "."); got != want {
		t.Fatalf("Version() = %q, header says %q", got, want)
	}
	if dayzero.LibraryABIVersion() != dayzero.ABIVersion {
		t.Fatalf("library ABI %d, header ABI %d", dayzero.LibraryABIVersion(), dayzero.ABIVersion)
	}
}

func TestBadPathError(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "no-such-model")
	m, err := dayzero.OpenModel(bad, nil)
	if err == nil || m != nil {
		t.Fatalf("OpenModel(%q) succeeded", bad)
	}
	var de *dayzero.Error
	if !errors.As(err, &de) {
		t.Fatalf("error %T is not *dayzero.Error", err)
	}
	if !errors.Is(err, dayzero.ErrIO) || de.Status != dayzero.ErrIO {
		t.Fatalf("status %v, want DZ_ERR_IO", de.Status)
	}
	if !strings.Contains(de.Message, bad) || !strings.Contains(err.Error(), "DZ_ERR_IO") {
		t.Fatalf("message does not name the path: %q", err.Error())
	}
}

func TestGreedyMatchesCAPI(t *testing.T) {
	want := referenceIDs(t)
	m, err := dayzero.OpenModel(env(t, "DAYZERO_TEST_MODEL"), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	info, err := m.Info()
	if err != nil || info.Architecture != "gpt_oss" || info.Vocab <= 0 {
		t.Fatalf("Info() = %+v, %v", info, err)
	}
	s := newSession(t, m)
	var got []int32
	err = s.Generate(context.Background(), prompt, dayzero.GenerateOptions{MaxTokens: nGen, Stop: []int32{}},
		func(tok dayzero.Token) error { got = append(got, tok.ID); return nil })
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("got %v, C API gave %v", got, want)
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("got %v, C API gave %v", got, want)
		}
	}
	if n, err := s.Len(); err != nil || n != len(prompt)+nGen {
		t.Fatalf("Len() = %d, %v; want %d", n, err, len(prompt)+nGen)
	}

	// Logits of the prompt: the greedy pick is their argmax.
	if err := s.Reset(); err != nil {
		t.Fatal(err)
	}
	if err := s.Append(prompt, dayzero.LogitsLast); err != nil {
		t.Fatal(err)
	}
	l, err := s.Logits()
	if err != nil || l.Rows != 1 || l.Vocab != info.Vocab {
		t.Fatalf("Logits() = %d x %d, %v", l.Rows, l.Vocab, err)
	}
	best := 0
	for i, v := range l.Row(0) {
		if v > l.Row(0)[best] {
			best = i
		}
	}
	if int32(best) != want[0] {
		t.Fatalf("argmax of the logits is %d, first generated id %d", best, want[0])
	}

	// A fork continues like its parent; batched steps match single steps.
	f, err := s.Fork()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ids, err := dayzero.GenerateStep([]*dayzero.Session{s, f})
	if err != nil || ids[0] != want[0] || ids[1] != want[0] {
		t.Fatalf("GenerateStep = %v, %v; want both %d", ids, err, want[0])
	}
}

func TestCloseOrderAndClosedHandles(t *testing.T) {
	m, err := dayzero.OpenModel(env(t, "DAYZERO_TEST_MODEL"), nil)
	if err != nil {
		t.Fatal(err)
	}
	a, err := m.NewArena(small)
	if err != nil {
		t.Fatal(err)
	}
	s, err := a.NewSession(&dayzero.SessionOptions{Sampler: dayzero.Sampler{Temperature: 0.7, TopK: 5, Seed: 3}})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err == nil {
		t.Fatal("closing an arena with an open session succeeded")
	}
	if err := m.Close(); err == nil {
		t.Fatal("closing a model with an open arena succeeded")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Append(prompt, dayzero.LogitsLast); err == nil {
		t.Fatal("Append on a closed session succeeded")
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil { // idempotent
		t.Fatal(err)
	}
}

func TestCancelledContext(t *testing.T) {
	m, err := dayzero.OpenModel(env(t, "DAYZERO_TEST_MODEL"), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	s := newSession(t, m)
	ctx, cancel := context.WithCancel(context.Background())
	n := 0
	err = s.Generate(ctx, prompt, dayzero.GenerateOptions{MaxTokens: nGen, Stop: []int32{}},
		func(dayzero.Token) error { n++; cancel(); return nil })
	if !errors.Is(err, context.Canceled) && !errors.Is(err, dayzero.ErrCancelled) {
		t.Fatalf("Generate after cancel: %v", err)
	}
	if n != 1 {
		t.Fatalf("%d tokens after cancelling at the first", n)
	}
	// The session is usable again after a cancelled call.
	if _, err := s.Step(); err != nil {
		t.Fatal(err)
	}
}

func TestReadmeExample(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("(?s)```go\n(.*?)```").FindSubmatch(readme)
	if m == nil {
		t.Fatal("README.md has no ```go block")
	}
	src, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	var body []string
	for _, line := range strings.Split(strings.TrimSpace(string(m[1])), "\n") {
		body = append(body, "\t"+line)
	}
	if !strings.Contains(string(src), strings.Join(body, "\n")) {
		t.Fatal("README.md's example is not the body of Example() in example_test.go")
	}
	Example() // runs it (an Example without an Output comment is only compiled)
}

func TestTextGeneration(t *testing.T) {
	dir := env(t, "DAYZERO_TEST_TEXT_MODEL")
	m, err := dayzero.OpenModel(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	tok, err := m.Tokenizer()
	if err != nil || tok == nil {
		t.Fatalf("Tokenizer() = %v, %v", tok, err)
	}
	ids, err := tok.Encode("hello there", false)
	if err != nil || len(ids) != 4 {
		t.Fatalf("Encode = %v, %v", ids, err)
	}
	if hello, err := tok.TokenID("hello"); err != nil || hello != ids[0] {
		t.Fatalf("TokenID(hello) = %d, %v; Encode gave %v", hello, err, ids)
	}
	if _, err := tok.TokenID("no such token"); !errors.Is(err, dayzero.ErrNotFound) {
		t.Fatalf("TokenID of a missing token: %v", err)
	}
	if text, err := tok.Decode(ids); err != nil || text != "hello there" {
		t.Fatalf("Decode = %q, %v", text, err)
	}
	if chat, err := tok.ApplyChatTemplate(`[{"role":"user","content":"hi"}]`, "", true); err != nil ||
		chat != "<|start|>user<|message|>hi<|end|><|start|>assistant" {
		t.Fatalf("ApplyChatTemplate = %q, %v", chat, err)
	}
	want, wantText := reference(t, dir, ids, 12)
	s := newSession(t, m)
	var got []int32
	var text strings.Builder
	err = s.Generate(context.Background(), ids, dayzero.GenerateOptions{MaxTokens: 12, Stop: []int32{}},
		func(tk dayzero.Token) error { got = append(got, tk.ID); text.WriteString(tk.Text); return nil })
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("ids %v, C API gave %v", got, want)
	}
	if text.String() != string(wantText) {
		t.Fatalf("streamed text %q, C API's detokenizer gave %q", text.String(), wantText)
	}
}
