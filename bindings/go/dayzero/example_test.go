package dayzero_test

import (
	"context"
	"fmt"
	"log"

	"dayzero"
)

// The README's example (TestReadmeExample checks that README.md shows this
// body verbatim, and runs it).
func Example() {
	m, err := dayzero.OpenModel("../../../tests/data/gpt_oss_tiny", nil) // a Hugging Face model folder
	if err != nil {
		log.Fatal(err) // *dayzero.Error: status and message
	}
	defer m.Close()
	s, err := m.NewSession(nil) // greedy sampling, its own KV arena
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	err = s.Generate(context.Background(), []int32{2, 17, 300}, dayzero.GenerateOptions{MaxTokens: 8},
		func(t dayzero.Token) error { fmt.Println(t.ID, t.Text); return nil }) // streamed as generated
	if err != nil {
		log.Fatal(err)
	}
}
