// The paged KV arena: fixed-size pages holding, per layer, whatever a model
// caches per token; per-sequence page tables; prefix sharing by hash chain;
// copy-on-write forks; LRU eviction of unreferenced cached pages; fixed-size
// recurrent-state slots for linear-attention layers. No fragmentation by
// construction: every allocation is one page.
//
// Page layout: [layer][slot in page][layer_token_bytes[layer]] so one layer's
// tokens of a page are contiguous; each layer's region starts 64-byte aligned
// (use layer_offset(), never recompute it).
//
// Storage layout: [pages][zero state][state slots][state snapshots], the
// state parts present only when layout.state_slot_bytes > 0.
//
// Page lifecycle: free -> used (referenced by sequences) -> on release either
// free again or, when the page is full and its hash is in the prefix index,
// cached (unreferenced, LRU). Cached pages are evicted (oldest first) only
// when an allocation finds no free page. A full page is immutable while it is
// indexed or shared: a sequence that writes into a shared or indexed partial
// last page (after truncate or fork) gets a private copy first.
//
// Thread safety: the Arena is internally synchronised (one mutex); each
// Sequence is used by one thread at a time, different Sequences of one arena
// may be used on different threads concurrently. Sequence accessors (pages(),
// page_of(), ...) read only the sequence's own state and take no lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "dayzero.h"

namespace dz::kv {

using PageId = uint32_t;
constexpr PageId kNoPage = UINT32_MAX;

// What a model caches, chosen by its family.
struct Layout {
  uint32_t page_tokens = 64;
  std::vector<size_t> layer_token_bytes;  // per layer; 0 for layers caching nothing per token (KDA)
  size_t state_slot_bytes = 0;            // recurrent state per sequence (all linear layers), 0 = none
  uint64_t model_key = 0;                 // salts prefix hashes (model identity + cache format)
};

// Backing memory of the pages and state slots: host memory for the CPU
// backend, device memory for CUDA. Must be zero-filled when created (the
// arena keeps one all-zero state that new sequences start from).
class Storage {
 public:
  virtual ~Storage() = default;
  virtual uint8_t* data() = 0;  // host or device address of byte 0
  virtual size_t size() const = 0;
  virtual void copy(size_t dst_off, size_t src_off, size_t bytes) = 0;  // within this storage, no overlap
  // Between host memory and this storage (after any work in flight on it).
  virtual void read(size_t off, void* dst, size_t bytes) = 0;
  virtual void write(size_t off, const void* src, size_t bytes) = 0;
  virtual bool on_device() const = 0;
};
std::unique_ptr<Storage> make_host_storage(size_t bytes);  // zero-filled OS pages, committed on first touch

struct ArenaConfig {
  uint64_t capacity_pages = 0;  // > 0
  uint32_t max_state_slots = 64;
  bool prefix_cache = true;
  uint32_t max_state_snapshots = 0;  // hybrid prefix caching; 0 = max_state_slots (unused without state)
};

class Sequence;

class Arena {
 public:
  // Storage is created by make_storage(storage_bytes(layout, cfg)) once, at
  // construction. Throws DZ_ERR_INVALID_ARGUMENT for an unusable layout/config.
  Arena(Layout layout, ArenaConfig cfg, std::unique_ptr<Storage> (*make_storage)(size_t) = make_host_storage);
  ~Arena();  // every Sequence must be destroyed first
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Bytes of one page for this layout (all layers, aligned).
  static size_t page_bytes_for(const Layout& layout);
  // Total storage an arena of this layout and config needs.
  static size_t storage_bytes(const Layout& layout, const ArenaConfig& cfg);
  // Pages that fit in `bytes` next to cfg's state slots and snapshots (0 if none).
  static uint64_t pages_for_bytes(const Layout& layout, const ArenaConfig& cfg, uint64_t bytes);

  const Layout& layout() const { return layout_; }
  const ArenaConfig& config() const { return cfg_; }
  uint32_t page_tokens() const { return layout_.page_tokens; }
  size_t page_bytes() const { return page_bytes_; }
  size_t layer_offset(uint32_t layer) const { return layer_offsets_[layer]; }  // within a page
  // Address of token `slot` (0..page_tokens-1) of `layer` in page p.
  uint8_t* token_ptr(PageId p, uint32_t layer, uint32_t slot) {
    return storage_->data() + size_t(p) * page_bytes_ + layer_offsets_[layer] +
           size_t(slot) * layout_.layer_token_bytes[layer];
  }
  uint8_t* page_ptr(PageId p) { return storage_->data() + size_t(p) * page_bytes_; }
  Storage& storage() { return *storage_; }

  dz_kv_stats stats() const;  // struct_size set
  // Host bytes of bookkeeping: page metadata, hash index, snapshot table and
  // every live sequence's page table and token ids.
  uint64_t metadata_bytes() const;

  // Invariant check for tests: throws dz::Error (DZ_ERR_INTERNAL) describing
  // the first violation. verify_hashes also recomputes every sequence's hash
  // chain from its tokens (O(total tokens)).
  void check_invariants(bool verify_hashes = true) const;

 private:
  friend class Sequence;
  struct Impl;
  uint64_t metadata_bytes_locked() const;
  Layout layout_;
  ArenaConfig cfg_;
  size_t page_bytes_ = 0;
  std::vector<size_t> layer_offsets_;
  std::unique_ptr<Storage> storage_;
  std::unique_ptr<Impl> impl_;
  mutable std::mutex mu_;  // guards impl_ and every sequence's page table / tokens mutation
};

// One sequence: its page table, the token ids it holds (for prefix hashing),
// and its recurrent-state slot. Not thread-safe itself; different Sequences
// may be used on different threads.
//
// The write protocol of a forward pass: n = adopt_prefix(prompt) (optional),
// reserve(k) for the k tokens still to compute, the model writes their KV at
// page_of(pos)/slot_of(pos) for pos in [length(), length()+k), then commit(ids)
// on success or rollback() on failure.
class Sequence {
 public:
  // Acquires a state slot when the layout has recurrent state (DZ_ERR_KV_FULL
  // when none is free); the state starts zeroed.
  explicit Sequence(Arena& arena);
  ~Sequence();  // releases its pages and state slot
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  Arena& arena() const { return *arena_; }
  size_t length() const { return tokens_.size(); }  // tokens whose KV is written
  size_t reserved() const { return reserved_; }     // room beyond length()
  const std::vector<int32_t>& tokens() const { return tokens_; }
  // Pages covering [0, length()+reserved()).
  const std::vector<PageId>& pages() const { return pages_; }
  // Page and slot holding position pos (< length() + reserved()).
  PageId page_of(size_t pos) const { return pages_[pos / arena_->page_tokens()]; }
  uint32_t slot_of(size_t pos) const { return uint32_t(pos % arena_->page_tokens()); }

  // Prefix cache: when length() is page-aligned, adopt cached full pages that
  // continue this sequence with tokens[0..]. Reuses at most tokens.size()-1
  // tokens (the last token is always computed, so logits exist). Returns the
  // number of tokens adopted (a multiple of page_tokens); length() grows by it.
  // With recurrent state, only up to the last page boundary that has a state
  // snapshot, which is restored into state_ptr(). Counts tokens.size() as
  // requested in the arena's stats (call it once per prefill). Requires no
  // reserved room (DZ_ERR_INVALID_ARGUMENT).
  size_t adopt_prefix(std::span<const int32_t> tokens);
  // Make room to write positions [length(), length()+n): allocate pages
  // (evicting LRU cached pages if needed) and copy a shared or cached
  // partially-filled last page (copy on write). Room already reserved counts
  // (reserve(5) twice gives room for 5). All or nothing: on DZ_ERR_KV_FULL
  // the sequence is unchanged.
  void reserve(size_t n);
  // The model has written KV for positions [length(), length()+ids.size()):
  // record them (ids.size() <= reserved()); newly filled pages enter the
  // prefix cache.
  void commit(std::span<const int32_t> ids);
  // Drop reserved-but-uncommitted room (after a failed forward).
  void rollback();
  // Keep the first n tokens (n <= length()); drops reserved room. With
  // recurrent state, n must be length(), 0, or a page boundary with a state
  // snapshot (else DZ_ERR_UNSUPPORTED, sequence unchanged).
  void truncate(size_t n);
  // Keep the first n tokens (n <= length()), drop reserved room, and set the
  // recurrent state to `state` (state_slot_bytes of host memory: the state
  // after those n tokens, which the caller saved). Puts a hybrid model's
  // sequence back after a failed multi-chunk prefill, where truncate() would
  // need a snapshot (the state written through Storage::write, so device slots
  // too). DZ_ERR_UNSUPPORTED without state.
  void rewind(size_t n, const uint8_t* state);
  // A new sequence sharing this one's pages (copy on write) and a copy of its
  // state; reserved room is not shared.
  std::unique_ptr<Sequence> fork() const;

  // Recurrent state (layout.state_slot_bytes > 0): a slot owned by this
  // sequence, acquired at construction; nullptr without recurrent state.
  uint8_t* state_ptr();
  // Hybrid prefix caching: snapshot the state as of position pos so a later
  // adopt_prefix can restore it. pos must equal length() (the state slot holds
  // the state after length() tokens) and be a positive page boundary. No-op
  // without recurrent state or with the prefix cache off.
  void snapshot_state(size_t pos);

  uint64_t tokens_reused() const { return tokens_reused_; }

 private:
  friend class Arena;
  friend struct Arena::Impl;
  Arena* arena_;
  std::vector<PageId> pages_;
  std::vector<int32_t> tokens_;
  size_t reserved_ = 0;  // tokens of room beyond length()
  int32_t state_slot_ = -1;
  uint64_t tokens_reused_ = 0;
};

}  // namespace dz::kv
