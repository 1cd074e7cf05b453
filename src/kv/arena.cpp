// The paged KV arena (see arena.h for the model). Bookkeeping is kept small
// and flat: 32 bytes of metadata per page, an open-addressing hash index of
// page ids (4 bytes per slot, load <= 1/2), intrusive free and LRU lists
// threaded through the page metadata, and 4 bytes per page in each sequence's
// page table.
#include "kv/arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "common/error.h"
#include "common/host_alloc.h"
#include "common/log.h"

namespace dz::kv {

namespace {

constexpr size_t kLayerAlign = 64;
constexpr size_t kStateAlign = 256;

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Multiplication that refuses to overflow (sizes come from configs).
size_t mul_checked(size_t a, size_t b, const char* what) {
  if (a && b > SIZE_MAX / a) fail(DZ_ERR_INVALID_ARGUMENT, "KV arena: ", what, " overflows");
  return a * b;
}

// Pages come straight from the OS as anonymous zero pages: they are committed
// on first touch, so creating a large arena costs no time and no memory for
// pages never used (zero-filling 256 MiB up front took seconds).
class HostStorage final : public Storage {
 public:
  explicit HostStorage(size_t bytes) : size_(bytes) {
    void* p = ::mmap(nullptr, bytes ? bytes : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail(DZ_ERR_OUT_OF_MEMORY, "KV arena: cannot reserve ", bytes, " bytes of host memory");
    data_ = static_cast<uint8_t*>(p);
  }
  ~HostStorage() override { ::munmap(data_, size_ ? size_ : 1); }
  uint8_t* data() override { return data_; }
  size_t size() const override { return size_; }
  void copy(size_t dst, size_t src, size_t bytes) override {
    check(dst + bytes <= size_ && src + bytes <= size_, DZ_ERR_INTERNAL, "KV storage copy out of range");
    std::memcpy(data_ + dst, data_ + src, bytes);
  }
  void read(size_t off, void* dst, size_t bytes) override {
    check(off + bytes <= size_, DZ_ERR_INTERNAL, "KV storage read out of range");
    std::memcpy(dst, data_ + off, bytes);
  }
  void write(size_t off, const void* src, size_t bytes) override {
    check(off + bytes <= size_, DZ_ERR_INTERNAL, "KV storage write out of range");
    std::memcpy(data_ + off, src, bytes);
  }
  bool on_device() const override { return false; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// 64-bit finaliser (splitmix64): every input bit affects every output bit.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// Two independent 64-bit lanes: h1 keys the index, h2 confirms a match, so a
// wrong prefix hit needs a 128-bit collision.
struct Hash {
  uint64_t h1 = 0, h2 = 0;
  bool operator==(const Hash&) const = default;
};

Hash root_hash(const Layout& l) {
  return {mix64(l.model_key ^ 0x6a09e667f3bcc908ULL) ^ l.page_tokens,
          mix64(l.model_key + 0xbb67ae8584caa73bULL) + l.page_tokens};
}

Hash chain_hash(Hash parent, std::span<const int32_t> toks) {
  uint64_t a = parent.h1, b = parent.h2;
  for (int32_t t : toks) {
    const uint64_t v = uint32_t(t);
    a = mix64(a ^ (v * 0x9e3779b97f4a7c15ULL));
    b = mix64(b + v + 0x3c6ef372fe94f82bULL) ^ (b >> 17);
  }
  return {mix64(a ^ toks.size()), mix64(b + 0xa54ff53a5f1d36f1ULL)};
}

enum class Where : uint8_t { kFree, kUsed, kCached };

}  // namespace

std::unique_ptr<Storage> make_host_storage(size_t bytes) { return std::make_unique<HostStorage>(bytes); }

struct Arena::Impl {
  struct PageMeta {
    uint64_t h1 = 0, h2 = 0;  // chain hash, valid when full
    uint32_t ref = 0;
    PageId prev = kNoPage, next = kNoPage;  // free list (next only) or LRU list
    Where where = Where::kFree;
    bool full = false;     // all page_tokens slots written; hash valid
    bool indexed = false;  // in the prefix index (implies full)
  };
  struct Snapshot {
    Hash h;
    uint64_t stamp = 0;  // last use; 0 = empty
  };

  Arena& a;
  const uint32_t P;
  std::vector<PageMeta> meta;
  PageId free_head = kNoPage;
  PageId lru_head = kNoPage, lru_tail = kNoPage;  // head = least recently released
  uint64_t n_free = 0, n_cached = 0, n_used = 0;

  std::vector<PageId> table;  // open addressing, linear probing, key meta[p].h1
  size_t table_mask = 0;
  uint64_t n_indexed = 0;

  // Recurrent state.
  size_t state_stride = 0, state_base = 0;
  std::vector<uint32_t> free_slots;
  std::vector<Snapshot> snaps;
  std::unordered_map<uint64_t, uint32_t> snap_index;  // h1 -> snapshot
  uint64_t snap_clock = 0;

  std::unordered_set<const Sequence*> seqs;
  uint64_t tokens_requested = 0, tokens_reused = 0, evictions = 0;

  Impl(Arena& arena, uint64_t capacity) : a(arena), P(arena.layout_.page_tokens), meta(capacity) {
    for (PageId p = PageId(capacity); p-- > 0;) push_free(p);
    size_t t = 16;
    while (t < 2 * capacity) t <<= 1;
    table.assign(t, kNoPage);
    table_mask = t - 1;
  }

  Hash hash_of(PageId p) const { return {meta[p].h1, meta[p].h2}; }

  // ---------------------------------------------------------- free / LRU lists
  void push_free(PageId p) {
    auto& m = meta[p];
    m = PageMeta{};
    m.next = free_head;
    free_head = p;
    ++n_free;
  }
  void lru_unlink(PageId p) {
    auto& m = meta[p];
    (m.prev == kNoPage ? lru_head : meta[m.prev].next) = m.next;
    (m.next == kNoPage ? lru_tail : meta[m.next].prev) = m.prev;
    m.prev = m.next = kNoPage;
    --n_cached;
  }
  void lru_push_back(PageId p) {
    auto& m = meta[p];
    m.where = Where::kCached;
    m.prev = lru_tail;
    m.next = kNoPage;
    (lru_tail == kNoPage ? lru_head : meta[lru_tail].next) = p;
    lru_tail = p;
    ++n_cached;
  }

  // ---------------------------------------------------------- hash index
  size_t home(uint64_t h1) const { return size_t(mix64(h1)) & table_mask; }
  PageId index_find(Hash h) const {
    for (size_t i = home(h.h1);; i = (i + 1) & table_mask) {
      const PageId q = table[i];
      if (q == kNoPage) return kNoPage;
      if (meta[q].h1 == h.h1 && meta[q].h2 == h.h2) return q;
    }
  }
  void index_insert(PageId p) {
    size_t i = home(meta[p].h1);
    while (table[i] != kNoPage) i = (i + 1) & table_mask;
    table[i] = p;
    meta[p].indexed = true;
    ++n_indexed;
  }
  void index_erase(PageId p) {
    size_t i = home(meta[p].h1);
    while (table[i] != p) {
      if (table[i] == kNoPage) fail(DZ_ERR_INTERNAL, "KV index: page ", p, " marked indexed but absent");
      i = (i + 1) & table_mask;
    }
    // Backward-shift deletion keeps every probe chain unbroken without tombstones.
    for (size_t j = i;;) {
      j = (j + 1) & table_mask;
      const PageId q = table[j];
      if (q == kNoPage) break;
      const size_t k = home(meta[q].h1);
      const bool movable = (i <= j) ? (k <= i || k > j) : (k <= i && k > j);
      if (movable) {
        table[i] = q;
        i = j;
      }
    }
    table[i] = kNoPage;
    meta[p].indexed = false;
    --n_indexed;
    drop_snapshot(hash_of(p));
  }

  // ---------------------------------------------------------- pages
  uint64_t available() const { return n_free + n_cached; }

  // Caller has checked available() > 0.
  PageId alloc_page() {
    if (free_head == kNoPage) {
      const PageId victim = lru_head;
      if (victim == kNoPage) fail(DZ_ERR_INTERNAL, "KV arena: allocation without an available page");
      lru_unlink(victim);
      index_erase(victim);
      ++evictions;
      meta[victim].where = Where::kFree;
      push_free(victim);
    }
    const PageId p = free_head;
    free_head = meta[p].next;
    --n_free;
    meta[p] = PageMeta{};
    meta[p].where = Where::kUsed;
    meta[p].ref = 1;
    ++n_used;
    return p;
  }

  void add_ref(PageId p) {
    auto& m = meta[p];
    if (m.ref == 0) {
      lru_unlink(p);
      m.where = Where::kUsed;
      ++n_used;
    }
    ++m.ref;
  }

  void release(PageId p) {
    auto& m = meta[p];
    if (m.ref == 0) fail(DZ_ERR_INTERNAL, "KV arena: release of unreferenced page ", p);
    if (--m.ref) return;
    --n_used;
    // A full page whose hash is not yet cached (a duplicate computed while the
    // original was live, or one whose original was evicted) takes its place.
    if (m.full && a.cfg_.prefix_cache && !m.indexed && index_find(hash_of(p)) == kNoPage) index_insert(p);
    if (m.indexed)
      lru_push_back(p);
    else
      push_free(p);
  }

  // Release pages[from..] newest first, so a prefix's root page ends up most
  // recently used and its descendants are evicted before it.
  void release_tail(Sequence& s, size_t from) {
    while (s.pages_.size() > from) {
      release(s.pages_.back());
      s.pages_.pop_back();
    }
  }

  // Capacity for n elements, growing geometrically (a decode step must not
  // reallocate the page table every page).
  template <typename V>
  static void grow(V& v, size_t n) {
    if (n > v.capacity()) v.reserve(std::max(n, 2 * v.capacity()));
  }

  size_t pages_for(size_t tokens) const { return (tokens + P - 1) / P; }

  // ---------------------------------------------------------- state
  size_t slot_off(int32_t slot) const { return state_base + (1 + size_t(slot)) * state_stride; }
  size_t snap_off(uint32_t i) const { return state_base + (1 + size_t(a.cfg_.max_state_slots) + i) * state_stride; }
  bool has_state() const { return a.layout_.state_slot_bytes > 0; }
  int32_t acquire_slot() {
    if (free_slots.empty())
      fail(DZ_ERR_KV_FULL, "KV arena: all ", a.cfg_.max_state_slots,
           " recurrent-state slots are in use (raise max_sessions)");
    const int32_t s = int32_t(free_slots.back());
    free_slots.pop_back();
    a.storage_->copy(slot_off(s), state_base, a.layout_.state_slot_bytes);  // zero state
    return s;
  }
  const Snapshot* find_snapshot(Hash h) const {
    auto it = snap_index.find(h.h1);
    if (it == snap_index.end() || !(snaps[it->second].h == h)) return nullptr;
    return &snaps[it->second];
  }
  uint32_t snap_id(const Snapshot* s) const { return uint32_t(s - snaps.data()); }
  void drop_snapshot(Hash h) {
    if (snaps.empty()) return;
    if (const Snapshot* s = find_snapshot(h)) {
      snaps[snap_id(s)].stamp = 0;
      snap_index.erase(h.h1);
    }
  }
  void store_snapshot(Hash h, int32_t slot) {
    uint32_t id;
    if (const Snapshot* s = find_snapshot(h)) {
      id = snap_id(s);
    } else {
      // An empty entry, else the least recently used one.
      id = 0;
      for (uint32_t i = 1; i < snaps.size(); ++i)
        if (snaps[i].stamp < snaps[id].stamp) id = i;
      if (snaps[id].stamp) snap_index.erase(snaps[id].h.h1);
      auto old = snap_index.find(h.h1);  // same h1, different h2: replace
      if (old != snap_index.end()) {
        snaps[old->second].stamp = 0;
        snap_index.erase(old);
      }
      snaps[id].h = h;
      snap_index[h.h1] = id;
    }
    snaps[id].stamp = ++snap_clock;
    a.storage_->copy(snap_off(id), slot_off(slot), a.layout_.state_slot_bytes);
  }

  // ---------------------------------------------------------- sequence ops
  Hash parent_hash(const Sequence& s, size_t full_pages) const {
    return full_pages ? hash_of(s.pages_[full_pages - 1]) : root_hash(a.layout_);
  }

  [[noreturn]] void full_error(size_t need, const char* what) const {
    fail(DZ_ERR_KV_FULL, "KV arena full: ", what, " needs ", need, " page(s) but ", n_free, " are free and ", n_cached,
         " cached (", meta.size(), " pages of ", P, " tokens in total)");
  }

  void reserve(Sequence& s, size_t n) {
    const size_t len = s.tokens_.size();
    const size_t target = std::max(len + n, len + s.reserved_);
    const size_t want = pages_for(target);
    size_t need = want > s.pages_.size() ? want - s.pages_.size() : 0;
    // The partially filled last page must be private and mutable before the
    // model writes into it.
    enum { kNone, kCopy, kUnindex, kClearFull } cow = kNone;
    PageId last = kNoPage;
    if (n > 0 && len % P) {
      last = s.pages_[len / P];
      const auto& m = meta[last];
      if (m.ref > 1)
        cow = kCopy;
      else if (m.indexed)  // keep the cached page for others when a page can be had
        cow = available() >= need + 1 ? kCopy : kUnindex;
      else if (m.full)
        cow = kClearFull;
    }
    if (cow == kCopy) ++need;
    if (available() < need) full_error(need, "reserve");
    grow(s.pages_, want);  // the only step that can throw (host memory) comes before any change
    if (cow == kCopy) {
      const PageId p = alloc_page();
      a.storage_->copy(size_t(p) * a.page_bytes_, size_t(last) * a.page_bytes_, a.page_bytes_);
      s.pages_[len / P] = p;
      release(last);
    } else if (cow == kUnindex) {
      lru_safe_unindex(last);
    } else if (cow == kClearFull) {
      meta[last].full = false;
    }
    while (s.pages_.size() < want) s.pages_.push_back(alloc_page());
    s.reserved_ = target - len;
  }

  void lru_safe_unindex(PageId p) {
    index_erase(p);
    meta[p].full = false;
  }

  void commit(Sequence& s, std::span<const int32_t> ids) {
    if (ids.size() > s.reserved_)
      fail(DZ_ERR_INVALID_ARGUMENT, "KV sequence: commit of ", ids.size(), " tokens exceeds the ", s.reserved_,
           " reserved");
    const size_t len = s.tokens_.size();
    grow(s.tokens_, len + ids.size());
    s.tokens_.insert(s.tokens_.end(), ids.begin(), ids.end());
    s.reserved_ -= ids.size();
    const size_t new_len = s.tokens_.size();
    for (size_t i = len / P; (i + 1) * P <= new_len; ++i) {
      const PageId p = s.pages_[i];
      auto& m = meta[p];
      if (m.full) fail(DZ_ERR_INTERNAL, "KV sequence: page ", p, " filled twice (copy on write missed)");
      const Hash h = chain_hash(parent_hash(s, i), std::span(s.tokens_).subspan(i * P, P));
      m.h1 = h.h1;
      m.h2 = h.h2;
      m.full = true;
      if (a.cfg_.prefix_cache && index_find(h) == kNoPage) index_insert(p);
    }
  }

  void rollback(Sequence& s) {
    release_tail(s, pages_for(s.tokens_.size()));
    s.reserved_ = 0;
  }

  size_t adopt_prefix(Sequence& s, std::span<const int32_t> toks) {
    if (s.reserved_)
      fail(DZ_ERR_INVALID_ARGUMENT, "KV sequence: adopt_prefix with ", s.reserved_,
           " tokens of reserved room; commit or roll back first");
    tokens_requested += toks.size();
    const size_t len = s.tokens_.size();
    if (!a.cfg_.prefix_cache || toks.size() < 2 || len % P) return 0;
    const size_t max_pages = (toks.size() - 1) / P;
    Hash h = parent_hash(s, len / P);
    std::vector<PageId> found;
    size_t take = 0;
    const Snapshot* snap = nullptr;
    for (size_t i = 0; i < max_pages; ++i) {
      h = chain_hash(h, toks.subspan(i * P, P));
      const PageId q = index_find(h);
      if (q == kNoPage) break;
      found.push_back(q);
      if (!has_state()) {
        take = found.size();
      } else if (const Snapshot* sn = find_snapshot(h)) {
        take = found.size();
        snap = sn;
      }
    }
    if (!take) return 0;
    grow(s.pages_, s.pages_.size() + take);
    grow(s.tokens_, s.tokens_.size() + take * P);
    for (size_t i = 0; i < take; ++i) {
      add_ref(found[i]);
      s.pages_.push_back(found[i]);
    }
    s.tokens_.insert(s.tokens_.end(), toks.begin(), toks.begin() + take * P);
    if (snap) {
      snaps[snap_id(snap)].stamp = ++snap_clock;
      a.storage_->copy(slot_off(s.state_slot_), snap_off(snap_id(snap)), a.layout_.state_slot_bytes);
    }
    const size_t n = take * P;
    tokens_reused += n;
    s.tokens_reused_ += n;
    return n;
  }

  void truncate(Sequence& s, size_t n) {
    const size_t len = s.tokens_.size();
    if (n > len) fail(DZ_ERR_INVALID_ARGUMENT, "KV sequence: truncate to ", n, " tokens but it holds ", len);
    const Snapshot* snap = nullptr;
    if (has_state() && n != len && n != 0) {
      if (n % P == 0 && meta[s.pages_[n / P - 1]].full) snap = find_snapshot(hash_of(s.pages_[n / P - 1]));
      if (!snap)
        fail(DZ_ERR_UNSUPPORTED, "KV sequence: cannot rewind the recurrent state to position ", n,
             " (only to 0, the current length, or a page boundary with a state snapshot)");
    }
    release_tail(s, pages_for(n));
    s.tokens_.resize(n);
    s.reserved_ = 0;
    if (has_state() && n != len) {
      if (snap) {
        snaps[snap_id(snap)].stamp = ++snap_clock;
        a.storage_->copy(slot_off(s.state_slot_), snap_off(snap_id(snap)), a.layout_.state_slot_bytes);
      } else {
        a.storage_->copy(slot_off(s.state_slot_), state_base, a.layout_.state_slot_bytes);
      }
    }
  }

  void rewind(Sequence& s, size_t n, const uint8_t* state) {
    if (!has_state()) fail(DZ_ERR_UNSUPPORTED, "KV sequence: rewind with a saved state but the layout has none");
    if (n > s.tokens_.size())
      fail(DZ_ERR_INVALID_ARGUMENT, "KV sequence: rewind to ", n, " tokens but it holds ", s.tokens_.size());
    release_tail(s, pages_for(n));
    s.tokens_.resize(n);
    s.reserved_ = 0;
    a.storage_->write(slot_off(s.state_slot_), state, a.layout_.state_slot_bytes);
  }

  void snapshot_state(Sequence& s, size_t pos) {
    if (!has_state() || !a.cfg_.prefix_cache) return;
    if (pos != s.tokens_.size() || pos == 0 || pos % P)
      fail(DZ_ERR_INVALID_ARGUMENT, "KV sequence: state snapshot at ", pos, " but the sequence holds ",
           s.tokens_.size(), " tokens (must be that length, a positive multiple of ", P, ")");
    store_snapshot(hash_of(s.pages_[pos / P - 1]), s.state_slot_);
  }

  void destroy(Sequence& s) noexcept {
    release_tail(s, 0);
    if (s.state_slot_ >= 0) free_slots.push_back(uint32_t(s.state_slot_));
    s.state_slot_ = -1;
    seqs.erase(&s);
  }
};

// ------------------------------------------------------------------ Arena

size_t Arena::page_bytes_for(const Layout& l) {
  size_t off = 0;
  for (size_t b : l.layer_token_bytes) off = round_up(off + mul_checked(b, l.page_tokens, "page size"), kLayerAlign);
  return off;
}

size_t Arena::storage_bytes(const Layout& l, const ArenaConfig& cfg) {
  size_t bytes = mul_checked(page_bytes_for(l), size_t(cfg.capacity_pages), "capacity");
  if (l.state_slot_bytes) {
    const size_t snaps =
        cfg.prefix_cache ? (cfg.max_state_snapshots ? cfg.max_state_snapshots : cfg.max_state_slots) : 0;
    const size_t slots = 1 + size_t(cfg.max_state_slots) + snaps;
    const size_t state = mul_checked(round_up(l.state_slot_bytes, kStateAlign), slots, "state slots");
    bytes = round_up(bytes, kStateAlign);
    if (bytes + state < bytes) fail(DZ_ERR_INVALID_ARGUMENT, "KV arena: storage size overflows");
    bytes += state;
  }
  return bytes;
}

uint64_t Arena::pages_for_bytes(const Layout& l, const ArenaConfig& cfg, uint64_t bytes) {
  ArenaConfig c = cfg;
  c.capacity_pages = 0;
  const uint64_t state = storage_bytes(l, c) + kStateAlign;  // + worst-case alignment padding
  const size_t pb = page_bytes_for(l);
  if (bytes <= state || pb == 0) return 0;
  return std::min<uint64_t>((bytes - state) / pb, kNoPage - 1);
}

Arena::Arena(Layout layout, ArenaConfig cfg, std::unique_ptr<Storage> (*make_storage)(size_t))
    : layout_(std::move(layout)), cfg_(cfg) {
  check(layout_.page_tokens > 0 && layout_.page_tokens <= (1u << 20), DZ_ERR_INVALID_ARGUMENT,
        "KV arena: page_tokens must be in 1..1048576, got ", layout_.page_tokens);
  check(cfg_.capacity_pages > 0 && cfg_.capacity_pages < kNoPage, DZ_ERR_INVALID_ARGUMENT,
        "KV arena: capacity_pages must be in 1..", kNoPage - 1, ", got ", cfg_.capacity_pages);
  check(make_storage != nullptr, DZ_ERR_INVALID_ARGUMENT, "KV arena: no storage factory");
  if (layout_.state_slot_bytes) {
    check(cfg_.max_state_slots > 0, DZ_ERR_INVALID_ARGUMENT,
          "KV arena: the model keeps recurrent state but max_state_slots is 0");
    if (!cfg_.max_state_snapshots) cfg_.max_state_snapshots = cfg_.max_state_slots;
    if (!cfg_.prefix_cache) cfg_.max_state_snapshots = 0;
  } else {
    cfg_.max_state_slots = 0;
    cfg_.max_state_snapshots = 0;
  }
  size_t off = 0;
  for (size_t b : layout_.layer_token_bytes) {
    layer_offsets_.push_back(off);
    off = round_up(off + mul_checked(b, layout_.page_tokens, "page size"), kLayerAlign);
  }
  page_bytes_ = off;
  const size_t total = storage_bytes(layout_, cfg_);
  storage_ = make_storage(total);
  check(storage_ && storage_->size() >= total, DZ_ERR_INTERNAL, "KV arena: storage smaller than the ", total,
        " bytes asked for");
  impl_ = std::make_unique<Impl>(*this, cfg_.capacity_pages);
  if (layout_.state_slot_bytes) {
    impl_->state_stride = round_up(layout_.state_slot_bytes, kStateAlign);
    impl_->state_base = round_up(page_bytes_ * cfg_.capacity_pages, kStateAlign);
    for (uint32_t s = cfg_.max_state_slots; s-- > 0;) impl_->free_slots.push_back(s);
    impl_->snaps.resize(cfg_.max_state_snapshots);
  }
}

Arena::~Arena() {
  if (impl_ && !impl_->seqs.empty())
    log(DZ_LOG_ERROR, cat("KV arena destroyed with ", impl_->seqs.size(), " live sequence(s)"));
}

dz_kv_stats Arena::stats() const {
  std::lock_guard lk(mu_);
  dz_kv_stats s{};
  s.struct_size = sizeof(s);
  s.page_tokens = layout_.page_tokens;
  s.page_bytes = page_bytes_;
  s.pages_total = cfg_.capacity_pages;
  s.pages_used = impl_->n_used;
  s.pages_cached = impl_->n_cached;
  s.pages_free = impl_->n_free;
  s.bytes_total = storage_->size();
  s.tokens_requested = impl_->tokens_requested;
  s.tokens_reused = impl_->tokens_reused;
  s.evictions = impl_->evictions;
  s.state_slots_total = cfg_.max_state_slots;
  s.state_slots_used = uint32_t(cfg_.max_state_slots - impl_->free_slots.size());
  s.state_bytes = layout_.state_slot_bytes;
  s.state_snapshots_total = uint32_t(impl_->snaps.size());
  s.state_snapshots_used = uint32_t(impl_->snap_index.size());
  s.bytes_metadata = metadata_bytes_locked();
  return s;
}

uint64_t Arena::metadata_bytes() const {
  std::lock_guard lk(mu_);
  return metadata_bytes_locked();
}

uint64_t Arena::metadata_bytes_locked() const {
  const Impl& m = *impl_;
  // Hash-node containers: one node (key, value, next pointer, cached hash)
  // per element plus one bucket pointer.
  auto node_bytes = [](size_t elems, size_t buckets, size_t payload) {
    return elems * (payload + 2 * sizeof(void*)) + buckets * sizeof(void*);
  };
  uint64_t b = sizeof(Arena) + sizeof(Impl) + layer_offsets_.capacity() * sizeof(size_t) +
               layout_.layer_token_bytes.capacity() * sizeof(size_t) + m.meta.capacity() * sizeof(Impl::PageMeta) +
               m.table.capacity() * sizeof(PageId) + m.free_slots.capacity() * sizeof(uint32_t) +
               m.snaps.capacity() * sizeof(Impl::Snapshot) +
               node_bytes(m.snap_index.size(), m.snap_index.bucket_count(), 16) +
               node_bytes(m.seqs.size(), m.seqs.bucket_count(), sizeof(void*));
  for (const Sequence* s : m.seqs)
    b += sizeof(Sequence) + s->pages_.capacity() * sizeof(PageId) + s->tokens_.capacity() * sizeof(int32_t);
  return b;
}

void Arena::check_invariants(bool verify_hashes) const {
  std::lock_guard lk(mu_);
  const Impl& m = *impl_;
  const size_t n = m.meta.size();
  auto bad = [](auto&&... parts) { fail(DZ_ERR_INTERNAL, "KV invariant: ", parts...); };
  // Free list.
  std::vector<uint8_t> seen(n, 0);  // 1 free, 2 cached
  uint64_t count = 0;
  for (PageId p = m.free_head; p != kNoPage; p = m.meta[p].next) {
    if (p >= n) bad("free list holds page ", p, " beyond capacity ", n);
    if (seen[p]) bad("free list loops at page ", p);
    seen[p] = 1;
    const auto& pm = m.meta[p];
    if (pm.where != Where::kFree || pm.ref || pm.indexed || pm.full)
      bad("free page ", p, " is marked in use (ref ", pm.ref, ", indexed ", pm.indexed, ")");
    ++count;
  }
  if (count != m.n_free) bad("free list has ", count, " pages, counter says ", m.n_free);
  // LRU list.
  count = 0;
  PageId prev = kNoPage;
  for (PageId p = m.lru_head; p != kNoPage; prev = p, p = m.meta[p].next) {
    if (p >= n) bad("LRU holds page ", p, " beyond capacity");
    if (seen[p]) bad("page ", p, " is both ", seen[p] == 1 ? "free" : "cached twice", " and cached");
    seen[p] = 2;
    const auto& pm = m.meta[p];
    if (pm.prev != prev) bad("LRU back link of page ", p, " is broken");
    if (pm.where != Where::kCached || pm.ref || !pm.indexed || !pm.full)
      bad("cached page ", p, " has ref ", pm.ref, ", indexed ", pm.indexed, ", full ", pm.full);
    ++count;
  }
  if (prev != m.lru_tail) bad("LRU tail is not the last page");
  if (count != m.n_cached) bad("LRU has ", count, " pages, counter says ", m.n_cached);
  // References from sequences.
  std::vector<uint32_t> refs(n, 0);
  std::vector<uint8_t> slot_owner(cfg_.max_state_slots, 0);
  const uint32_t P = m.P;
  for (const Sequence* s : m.seqs) {
    if (s->arena_ != this) bad("a registered sequence belongs to another arena");
    const size_t len = s->tokens_.size();
    if (s->pages_.size() != m.pages_for(len + s->reserved_))
      bad("sequence of ", len, " tokens + ", s->reserved_, " reserved has ", s->pages_.size(), " pages");
    for (PageId p : s->pages_) {
      if (p >= n) bad("sequence holds page ", p, " beyond capacity");
      if (seen[p]) bad("page ", p, " is ", seen[p] == 1 ? "free" : "cached", " but held by a sequence");
      ++refs[p];
    }
    Hash h = root_hash(layout_);
    for (size_t i = 0; i < len / P; ++i) {
      const auto& pm = m.meta[s->pages_[i]];
      if (!pm.full) bad("page ", s->pages_[i], " (index ", i, " of a sequence) holds ", P, " tokens but is not full");
      if (verify_hashes) {
        h = chain_hash(h, std::span(s->tokens_).subspan(i * P, P));
        if (!(h == m.hash_of(s->pages_[i]))) bad("page ", s->pages_[i], " hash does not match its tokens");
      }
    }
    // A partially filled page being written into must be exclusively owned.
    if (s->reserved_ && len % P) {
      const auto& pm = m.meta[s->pages_[len / P]];
      if (pm.indexed || pm.full) bad("a sequence writes into full/indexed page ", s->pages_[len / P]);
    }
    for (size_t i = m.pages_for(len); i < s->pages_.size(); ++i)
      if (m.meta[s->pages_[i]].ref != 1 || m.meta[s->pages_[i]].full)
        bad("reserved page ", s->pages_[i], " is shared or full");
    if ((s->state_slot_ >= 0) != m.has_state()) bad("sequence state slot ", s->state_slot_, " inconsistent");
    if (s->state_slot_ >= 0) {
      if (uint32_t(s->state_slot_) >= cfg_.max_state_slots || slot_owner[s->state_slot_]++)
        bad("state slot ", s->state_slot_, " out of range or owned twice");
    }
  }
  uint64_t used = 0, indexed = 0;
  for (PageId p = 0; p < n; ++p) {
    const auto& pm = m.meta[p];
    if (pm.ref != refs[p]) bad("page ", p, " has refcount ", pm.ref, " but ", refs[p], " references");
    if (pm.ref) {
      ++used;
      if (pm.where != Where::kUsed) bad("referenced page ", p, " not marked used");
    } else if (!seen[p]) {
      bad("page ", p, " is leaked: unreferenced, not free, not cached");
    }
    if (pm.indexed) {
      ++indexed;
      if (!pm.full) bad("indexed page ", p, " is not full");
      if (m.index_find(m.hash_of(p)) != p) bad("indexed page ", p, " is not found by its hash");
    }
  }
  if (used != m.n_used) bad(used, " pages referenced, counter says ", m.n_used);
  if (indexed != m.n_indexed) bad(indexed, " pages indexed, counter says ", m.n_indexed);
  uint64_t in_table = 0;
  for (PageId q : m.table)
    if (q != kNoPage) {
      if (q >= n || !m.meta[q].indexed) bad("index entry ", q, " is not an indexed page");
      ++in_table;
    }
  if (in_table != m.n_indexed) bad("index has ", in_table, " entries, ", m.n_indexed, " pages indexed");
  if (m.free_slots.size() + m.seqs.size() * (m.has_state() ? 1 : 0) != cfg_.max_state_slots)
    bad(m.free_slots.size(), " free state slots with ", m.seqs.size(), " sequences of ", cfg_.max_state_slots);
  size_t live_snaps = 0;
  for (const auto& sn : m.snaps)
    if (sn.stamp) {
      ++live_snaps;
      if (m.find_snapshot(sn.h) != &sn) bad("snapshot not reachable by its hash");
    }
  if (live_snaps != m.snap_index.size()) bad(live_snaps, " snapshots, ", m.snap_index.size(), " in the index");
}

// ------------------------------------------------------------------ Sequence

Sequence::Sequence(Arena& arena) : arena_(&arena) {
  std::lock_guard lk(arena_->mu_);
  if (arena_->impl_->has_state()) state_slot_ = arena_->impl_->acquire_slot();
  arena_->impl_->seqs.insert(this);
}

Sequence::~Sequence() {
  std::lock_guard lk(arena_->mu_);
  arena_->impl_->destroy(*this);
}

size_t Sequence::adopt_prefix(std::span<const int32_t> tokens) {
  std::lock_guard lk(arena_->mu_);
  return arena_->impl_->adopt_prefix(*this, tokens);
}

void Sequence::reserve(size_t n) {
  std::lock_guard lk(arena_->mu_);
  arena_->impl_->reserve(*this, n);
}

void Sequence::commit(std::span<const int32_t> ids) {
  std::lock_guard lk(arena_->mu_);
  arena_->impl_->commit(*this, ids);
}

void Sequence::rollback() {
  std::lock_guard lk(arena_->mu_);
  arena_->impl_->rollback(*this);
}

void Sequence::truncate(size_t n) {
  std::lock_guard lk(arena_->mu_);
  arena_->impl_->truncate(*this, n);
}

std::unique_ptr<Sequence> Sequence::fork() const {
  auto child = std::make_unique<Sequence>(*arena_);
  std::lock_guard lk(arena_->mu_);
  auto& impl = *arena_->impl_;
  const size_t len = tokens_.size();
  child->tokens_ = tokens_;
  child->pages_.assign(pages_.begin(), pages_.begin() + impl.pages_for(len));
  for (PageId p : child->pages_) impl.add_ref(p);
  if (state_slot_ >= 0)
    arena_->storage_->copy(impl.slot_off(child->state_slot_), impl.slot_off(state_slot_),
                           arena_->layout_.state_slot_bytes);
  return child;
}

uint8_t* Sequence::state_ptr() {
  if (state_slot_ < 0) return nullptr;
  return arena_->storage_->data() + arena_->impl_->slot_off(state_slot_);
}

void Sequence::rewind(size_t n, const uint8_t* state) {
  std::lock_guard lk(arena_->mu_);
  arena_->impl_->rewind(*this, n, state);
}

void Sequence::snapshot_state(size_t pos) {
  std::lock_guard lk(arena_->mu_);
  arena_->impl_->snapshot_state(*this, pos);
}

}  // namespace dz::kv
