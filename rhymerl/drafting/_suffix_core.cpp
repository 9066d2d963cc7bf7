// The compiled core of the history drafter: the occurrence index, longest-suffix matching and
// drafting (a path or a best-first tree) from matched occurrences, over a whole decode batch
// per call. `suffix_reference.py` is the same algorithm in Python; tests hold the two equal
// (same matches, same drafts, same probabilities to the bit).
//
// Why compiled: at batch 128 the Python version spent 15-20 % of rollout time here (about
// 3,500 index queries a rollout, each a Python loop over up to 64 occurrences).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using Tok = int64_t;
constexpr int kMinMatch = 3;
constexpr size_t kMaxOccurrences = 64;  // per query, most recent first: bounds work on repetitive text
constexpr Tok kVocabLimit = Tok(1) << 21;  // three ids pack into one 64-bit key

inline uint64_t gram_key(Tok a, Tok b, Tok c) {
  return ((uint64_t(a) * uint64_t(kVocabLimit)) + uint64_t(b)) * uint64_t(kVocabLimit) + uint64_t(c);
}

Tok to_token(PyObject* o) {
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (v < 0 || v >= kVocabLimit)
    throw py::value_error("token id " + std::to_string(v) + " is outside [0, 2**21): the suffix index packs three ids per key");
  return Tok(v);
}

// Items [start, len) of a Python list or tuple, as token ids (no Python-level slicing).
void read_tokens(py::handle seq, size_t start, std::vector<Tok>& out) {
  PyObject* o = seq.ptr();
  if (PyList_Check(o)) {
    Py_ssize_t n = PyList_GET_SIZE(o);
    for (Py_ssize_t i = Py_ssize_t(start); i < n; ++i) out.push_back(to_token(PyList_GET_ITEM(o, i)));
  } else if (PyTuple_Check(o)) {
    Py_ssize_t n = PyTuple_GET_SIZE(o);
    for (Py_ssize_t i = Py_ssize_t(start); i < n; ++i) out.push_back(to_token(PyTuple_GET_ITEM(o, i)));
  } else {
    py::sequence s = py::reinterpret_borrow<py::sequence>(seq);
    for (size_t i = start; i < s.size(); ++i) out.push_back(to_token(s[i].ptr()));
  }
}

size_t py_len(py::handle seq) {
  Py_ssize_t n = PyObject_Length(seq.ptr());
  if (n < 0) throw py::error_already_set();
  return size_t(n);
}

// Appends the last `n` tokens of prompt + output (reaching into the prompt early in a response).
void tail_into(py::handle output, py::handle prompt, size_t n, std::vector<Tok>& ctx) {
  size_t lo = py_len(output);
  if (lo >= n) {
    read_tokens(output, lo - n, ctx);
    return;
  }
  size_t lp = py_len(prompt), need = n - lo;
  read_tokens(prompt, lp > need ? lp - need : 0, ctx);
  read_tokens(output, 0, ctx);
}

std::vector<Tok> tail(py::handle output, py::handle prompt, size_t n) {
  std::vector<Tok> ctx;
  tail_into(output, prompt, n, ctx);
  return ctx;
}

struct Index;

// Position `pos` of sequence `sid` is the first token after a match.
struct Occ {
  const Index* idx;
  int32_t sid;
  int32_t pos;
};

struct Followed {
  int32_t sid;
  int64_t offset;
  py::object source;
};

// Where each 3-gram ends: an open-addressing table from the gram's key to the newest of its
// occurrences, which are chained newest to oldest in one flat vector. (A hash map of vectors
// allocated twice per new gram: most of the live siblings' per-step indexing.)
class GramTable {
 public:
  struct Entry {
    int32_t sid, end, prev;  // prev: this gram's previous (older) occurrence, -1 at the oldest
  };

  void add(uint64_t key, int32_t sid, int32_t end) {
    if ((used_ + 1) * 4 > slots_.size() * 3) grow();
    Slot& s = slots_[probe(key)];
    if (s.last < 0) {
      s.key = key;
      ++used_;
    }
    entries_.push_back({sid, end, s.last});
    s.last = int32_t(entries_.size() - 1);
  }

  // The newest occurrence of `key` (an index into entries()), -1 if there is none.
  int32_t newest(uint64_t key) const {
    if (slots_.empty()) return -1;
    return slots_[probe(key)].last;
  }

  const std::vector<Entry>& entries() const { return entries_; }

 private:
  struct Slot {
    uint64_t key = 0;
    int32_t last = -1;  // -1: an empty slot
  };

  static uint64_t mix(uint64_t k) {  // splitmix64's finaliser: packed ids are far from uniform
    k ^= k >> 30;
    k *= 0xbf58476d1ce4e5b9ULL;
    k ^= k >> 27;
    k *= 0x94d049bb133111ebULL;
    return k ^ (k >> 31);
  }

  size_t probe(uint64_t key) const {  // the key's slot, or the empty one where it would go
    const size_t mask = slots_.size() - 1;
    size_t i = mix(key) & mask;
    while (slots_[i].last >= 0 && slots_[i].key != key) i = (i + 1) & mask;
    return i;
  }

  void grow() {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(old.empty() ? 64 : old.size() * 2, Slot{});
    for (const Slot& s : old)
      if (s.last >= 0) slots_[probe(s.key)] = s;
  }

  std::vector<Slot> slots_;
  std::vector<Entry> entries_;
  size_t used_ = 0;
};

struct Index : std::enable_shared_from_this<Index> {
  std::vector<Followed> followed;  // live sequences mirrored from Python lists
  std::vector<std::vector<Tok>> seqs;
  std::vector<double> weights;
  std::vector<uint8_t> finals;  // the sequence really ended (a finished response)
  GramTable grams;              // 3-gram -> its (sid, end) occurrences
  size_t num_tokens = 0;

  void index_from(int32_t sid, size_t start) {
    const auto& s = seqs[sid];
    for (size_t end = std::max(start + 1, size_t(kMinMatch)); end <= s.size(); ++end)
      grams.add(gram_key(s[end - 3], s[end - 2], s[end - 1]), sid, int32_t(end));
  }

  int32_t add(py::handle tokens, double weight, bool final) {
    std::vector<Tok> t;
    read_tokens(tokens, 0, t);
    int32_t sid = int32_t(seqs.size());
    num_tokens += t.size();
    seqs.push_back(std::move(t));
    weights.push_back(weight);
    finals.push_back(final);
    index_from(sid, 0);
    return sid;
  }

  void check_sid(int32_t sid) const {
    if (sid < 0 || size_t(sid) >= seqs.size()) throw py::index_error("no sequence " + std::to_string(sid));
  }

  // Append `tokens[start:]` to sequence `sid` and index the grams they complete.
  void append(int32_t sid, py::handle tokens, size_t start) {
    check_sid(sid);
    size_t before = seqs[sid].size();
    read_tokens(tokens, start, seqs[sid]);
    num_tokens += seqs[sid].size() - before;
    index_from(sid, before);
  }

  // Append to every followed sequence what its source list has grown by.
  void sync() {
    for (const auto& f : followed) {
      size_t have = seqs[f.sid].size() - size_t(f.offset);
      if (have < py_len(f.source)) append(f.sid, f.source, have);
    }
  }

  // Occurrences of the longest suffix of `ctx` (min_match..max_match tokens); occurrences at
  // the growing end of a live sequence (no next token yet) are left out.
  int match(const std::vector<Tok>& ctx, int max_match, int min_match, std::vector<Occ>& found) const {
    const int n = int(ctx.size());
    if (n < kMinMatch) return 0;
    int32_t e = grams.newest(gram_key(ctx[n - 3], ctx[n - 2], ctx[n - 1]));
    if (e < 0) return 0;
    // The newest kMaxOccurrences occurrences, visited oldest first (first-seen order decides ties
    // downstream, as in the reference).
    const auto& entries = grams.entries();
    int32_t recent[kMaxOccurrences];
    size_t k = 0;
    for (; e >= 0 && k < kMaxOccurrences; e = entries[size_t(e)].prev) recent[k++] = e;
    int best = 0;
    while (k > 0) {
      const auto& hit = entries[size_t(recent[--k])];
      int32_t sid = hit.sid, end = hit.end;
      const auto& seq = seqs[sid];
      if (size_t(end) >= seq.size() && !finals[sid]) continue;
      int m = 3;
      while (m < max_match && m < n && end - m - 1 >= 0 && seq[end - m - 1] == ctx[n - m - 1]) ++m;
      if (m > best) {
        best = m;
        found.clear();
        found.push_back({this, sid, end});
      } else if (m == best) {
        found.push_back({this, sid, end});
      }
    }
    if (best < std::max(min_match, kMinMatch)) {
      found.clear();
      return 0;
    }
    return best;
  }
};

// A row's matched occurrences (possibly pooled from several indices, which it keeps alive).
struct Matches {
  int match = 0;
  std::vector<Occ> occ;
  std::vector<std::shared_ptr<const Index>> owners;

  Matches pooled(const Matches& other) const {
    Matches out = *this;
    out.occ.insert(out.occ.end(), other.occ.begin(), other.occ.end());
    out.owners.insert(out.owners.end(), other.owners.begin(), other.owners.end());
    return out;
  }
};

// Buffers reused across the rows of one batch call (no allocation per row once warm).
struct Scratch {
  std::vector<Tok> ctx;
  std::vector<Occ> best, cand, cur;
  std::vector<Tok> tokens;
  std::vector<double> weight;
};

// Follow the heaviest child while the running probability stays >= min_prob, appending to
// out / probs (and to support, when given: the weight of the continuations seen at each token's
// context). Per level: tally the continuations' weights (first-seen order), then keep the
// winner's occurrences in place.
void draft_path_into(const std::vector<Occ>& occ, int max_len, double min_prob, Scratch& sc,
                     std::vector<Tok>& out, std::vector<double>& probs, std::vector<double>* support = nullptr) {
  const size_t start = out.size();
  auto drafted = [&] { return int(out.size() - start); };
  if (occ.size() == 1) {  // one occurrence: its sequence, while it lasts (p stays 1)
    const Occ& o = occ[0];
    const auto& s = o.idx->seqs[o.sid];
    if (min_prob > 1.0) return;
    const double w = o.idx->weights[o.sid];
    for (size_t q = size_t(o.pos); q < s.size() && drafted() < max_len; ++q) {
      out.push_back(s[q]);
      probs.push_back(1.0);
      if (support) support->push_back(w);
    }
    return;
  }
  std::vector<Occ>& cur = sc.cur;
  cur.assign(occ.begin(), occ.end());
  std::vector<Tok>& tokens = sc.tokens;
  std::vector<double>& weight = sc.weight;
  double p = 1.0;
  while (drafted() < max_len && !cur.empty()) {
    const size_t depth = size_t(drafted());
    tokens.clear();
    weight.clear();
    double total = 0.0;
    for (const Occ& o : cur) {
      const auto& s = o.idx->seqs[o.sid];
      const double w = o.idx->weights[o.sid];
      size_t q = size_t(o.pos) + depth;
      if (q < s.size()) {
        Tok t = s[q];
        size_t j = 0;
        while (j < tokens.size() && tokens[j] != t) ++j;  // few distinct tokens: a scan beats a map
        if (j == tokens.size()) {
          tokens.push_back(t);
          weight.push_back(0.0);
        }
        weight[j] = weight[j] + w;
        total += w;
      } else if (o.idx->finals[o.sid]) {
        total += w;
      }
    }
    if (tokens.empty() || total <= 0) break;
    size_t j = 0;
    for (size_t k = 1; k < tokens.size(); ++k)
      if (weight[k] > weight[j]) j = k;  // the first of equal weights, as max() in Python
    p *= weight[j] / total;
    if (p < min_prob) break;
    const Tok t = tokens[j];
    out.push_back(t);
    probs.push_back(p);
    if (support) support->push_back(total);
    size_t kept = 0;
    for (const Occ& o : cur) {
      const auto& s = o.idx->seqs[o.sid];
      size_t q = size_t(o.pos) + depth;
      if (q < s.size() && s[q] == t) cur[kept++] = o;
    }
    cur.resize(kept);
  }
}

std::pair<std::vector<Tok>, std::vector<double>> draft_path(const Matches& m, int max_len, double min_prob) {
  Scratch sc;
  std::vector<Tok> out;
  std::vector<double> probs;
  draft_path_into(m.occ, max_len, min_prob, sc, out, probs);
  return {out, probs};
}

struct Pending {
  double p;
  double support;  // the weight of the continuations seen at the node's context
  long counter;
  int parent;
  Tok tok;
  size_t begin, end;  // the node's occurrences: arena[begin, end)
  int depth;
};

struct Worse {
  bool operator()(const Pending& a, const Pending& b) const {
    if (a.p != b.p) return a.p < b.p;  // the most probable first
    return a.counter > b.counter;      // then the earliest pushed
  }
};

// Best-first tree: repeatedly add the candidate node of highest estimated probability. Every
// candidate's occurrences live in one arena (no allocation per node).
std::tuple<std::vector<Tok>, std::vector<int>, std::vector<double>> draft_tree(const std::vector<Occ>& occ, int budget,
                                                                               int max_depth, double min_prob,
                                                                               std::vector<double>* support = nullptr) {
  std::vector<Tok> tokens;
  std::vector<int> parents;
  std::vector<double> probs;
  std::vector<Occ> arena(occ.begin(), occ.end());
  std::priority_queue<Pending, std::vector<Pending>, Worse> heap;
  long counter = 0;
  std::vector<Tok> toks;
  std::vector<double> weight;
  auto push_children = [&](int node, size_t begin, size_t end, int depth, double p) {
    if (depth >= max_depth) return;
    toks.clear();
    weight.clear();
    double total = 0.0;
    for (size_t i = begin; i < end; ++i) {  // tally, in first-seen order, as the reference
      const Occ& o = arena[i];
      const auto& s = o.idx->seqs[o.sid];
      const double w = o.idx->weights[o.sid];
      size_t q = size_t(o.pos) + size_t(depth);
      if (q < s.size()) {
        size_t j = 0;
        while (j < toks.size() && toks[j] != s[q]) ++j;
        if (j == toks.size()) {
          toks.push_back(s[q]);
          weight.push_back(0.0);
        }
        weight[j] = weight[j] + w;
        total += w;
      } else if (o.idx->finals[o.sid]) {
        total += w;
      }
    }
    if (total <= 0) return;
    for (size_t k = 0; k < toks.size(); ++k) {
      double cp = p * weight[k] / total;
      if (cp < min_prob) continue;
      size_t b0 = arena.size();
      for (size_t i = begin; i < end; ++i) {
        const Occ o = arena[i];  // a copy: the arena may grow
        const auto& s = o.idx->seqs[o.sid];
        size_t q = size_t(o.pos) + size_t(depth);
        if (q < s.size() && s[q] == toks[k]) arena.push_back(o);
      }
      ++counter;
      heap.push({cp, total, counter, node, toks[k], b0, arena.size(), depth + 1});
    }
  };
  push_children(-1, 0, arena.size(), 0, 1.0);
  while (!heap.empty() && int(tokens.size()) < budget) {
    Pending top = heap.top();
    heap.pop();
    tokens.push_back(top.tok);
    parents.push_back(top.parent);
    probs.push_back(top.p);
    if (support) support->push_back(top.support);
    push_children(int(tokens.size()) - 1, top.begin, top.end, top.depth, top.p);
  }
  return {tokens, parents, probs};
}

py::object match_one(const std::shared_ptr<Index>& idx, const std::vector<Tok>& ctx, int max_match, int min_match) {
  Matches m;
  m.match = idx->match(ctx, max_match, min_match, m.occ);
  if (m.occ.empty()) return py::none();
  m.owners.push_back(idx);
  return py::cast(std::move(m));
}

// The controller's longest-match rule over occurrence sources, for one row: each source in
// order offers an index to match (or matches it found itself); a longer match wins, an equal
// one of two merging sources pools its occurrences, a fallback source is asked only while
// the best match is shorter than pattern_max. Returns the winning source, or -1.
struct CastCache {
  PyObject* handle = nullptr;
  Index* index = nullptr;
  const Matches* matches = nullptr;
};

int longest_match(const std::vector<py::list>& per_source, const std::vector<bool>& merge,
                  const std::vector<bool>& fallback, std::vector<CastCache>& casts, size_t row, py::handle output,
                  py::handle prompt, int pattern_max, int pattern_min, Scratch& sc) {
  // The indices stay alive through the call (the per-source lists hold them): raw pointers.
  int winner = -1, best_match = 0;
  bool have_ctx = false;
  sc.best.clear();
  for (size_t k = 0; k < per_source.size(); ++k) {
    if (fallback[k] && winner >= 0 && best_match >= pattern_max) continue;
    py::handle h = PyList_GET_ITEM(per_source[k].ptr(), Py_ssize_t(row));
    if (h.is_none()) continue;
    CastCache& cache = casts[k];
    if (h.ptr() != cache.handle) {  // rows of one prompt share an index: cast it once
      cache.handle = h.ptr();
      cache.index = py::isinstance<Index>(h) ? h.cast<Index*>() : nullptr;
      cache.matches = cache.index ? nullptr : &h.cast<const Matches&>();
    }
    int m;
    const std::vector<Occ>* occ;
    if (cache.index) {
      if (!have_ctx) {
        sc.ctx.clear();
        tail_into(output, prompt, size_t(pattern_max), sc.ctx);
        have_ctx = true;
      }
      sc.cand.clear();
      m = cache.index->match(sc.ctx, pattern_max, pattern_min, sc.cand);
      occ = &sc.cand;
    } else {
      m = cache.matches->match;
      occ = &cache.matches->occ;
    }
    if (occ->empty()) continue;
    if (winner < 0 || m > best_match) {
      if (occ == &sc.cand)
        std::swap(sc.best, sc.cand);
      else
        sc.best.assign(occ->begin(), occ->end());
      best_match = m;
      winner = int(k);
    } else if (m == best_match && merge[k] && merge[size_t(winner)]) {
      sc.best.insert(sc.best.end(), occ->begin(), occ->end());
    }
  }
  return winner;
}

template <typename T>
py::object as_tuple(const std::vector<T>& v) {
  PyObject* t = PyTuple_New(Py_ssize_t(v.size()));
  if (!t) throw py::error_already_set();
  for (size_t j = 0; j < v.size(); ++j) PyTuple_SET_ITEM(t, Py_ssize_t(j), PyLong_FromLongLong((long long)v[j]));
  return py::reinterpret_steal<py::object>(t);
}

py::object as_list(const std::vector<double>& v) {
  PyObject* l = PyList_New(Py_ssize_t(v.size()));
  if (!l) throw py::error_already_set();
  for (size_t j = 0; j < v.size(); ++j) PyList_SET_ITEM(l, Py_ssize_t(j), PyFloat_FromDouble(v[j]));
  return py::reinterpret_steal<py::object>(l);
}

}  // namespace

PYBIND11_MODULE(_suffix_core, mod) {
  mod.doc() = "Compiled core of the suffix index and drafting from matches (see suffix_reference.py).";

  py::class_<Index, std::shared_ptr<Index>>(mod, "SuffixIndex",
      "Every position where a 3-gram ends, listed under that 3-gram; queried like a suffix tree.")
      .def(py::init<>())
      .def("add", &Index::add, py::arg("tokens"), py::arg("weight") = 1.0, py::arg("final") = true,
           "Index a sequence (a copy); returns its id.")
      .def("append", &Index::append, py::arg("sid"), py::arg("tokens"), py::arg("start") = 0,
           "Append tokens[start:] to sequence sid and index the grams they complete.")
      .def("follow", [](Index& self, int32_t sid, py::object source, int64_t offset) {
             self.check_sid(sid);
             if (offset < 0 || size_t(offset) > self.seqs[sid].size())
               throw py::value_error("follow: the offset is outside the sequence");
             self.followed.push_back({sid, offset, std::move(source)});
           }, py::arg("sid"), py::arg("source"), py::arg("offset"),
           "Let sequence sid mirror the list source (grown in place elsewhere) after offset tokens of "
           "its own; sync() appends what it has grown by.")
      .def("sync", &Index::sync, "Append to every followed sequence what its source has grown by (one call per step).")
      .def_static("sync_all", [](const std::vector<std::shared_ptr<Index>>& indices) {
             for (const auto& idx : indices) idx->sync();
           }, py::arg("indices"), "sync() of every index in one call (a decode step's live indices).")
      .def("size", [](const Index& self, int32_t sid) { self.check_sid(sid); return self.seqs[sid].size(); },
           "How many tokens sequence sid holds.")
      .def("tokens", [](const Index& self, int32_t sid) { self.check_sid(sid); return self.seqs[sid]; })
      .def_property_readonly("num_tokens", [](const Index& self) { return self.num_tokens; })
      .def("__len__", [](const Index& self) { return self.seqs.size(); })
      .def("match", [](const std::shared_ptr<Index>& self, py::handle context, int max_match, int min_match) {
             std::vector<Tok> ctx;
             read_tokens(context, 0, ctx);
             return match_one(self, ctx, max_match, min_match);
           }, py::arg("context"), py::arg("max_match"), py::arg("min_match") = kMinMatch,
           "Matches of the longest suffix of context (min_match..max_match tokens), or None.");

  py::class_<Matches>(mod, "Matches", "Occurrences of a matched context, where drafts continue from.")
      .def_readonly("match", &Matches::match, "How many context tokens matched.")
      .def("__len__", [](const Matches& self) { return self.occ.size(); })
      .def("__bool__", [](const Matches& self) { return !self.occ.empty(); })
      .def("__add__", &Matches::pooled, "Pool another source's occurrences (this one's match length).")
      .def("next_tokens", [](const Matches& self) {
             std::vector<Tok> out;
             for (const Occ& o : self.occ) {
               const auto& s = o.idx->seqs[o.sid];
               out.push_back(size_t(o.pos) < s.size() ? s[o.pos] : -1);
             }
             return out;
           }, "Per occurrence, the token that follows it (-1 where its sequence ended).")
      .def("most_recent", [](const Matches& self) {
             Matches out;
             out.match = self.match;
             size_t j = 0;
             for (size_t k = 1; k < self.occ.size(); ++k)
               if (self.occ[k].pos > self.occ[j].pos) j = k;
             if (!self.occ.empty()) out.occ.push_back(self.occ[j]);
             out.owners = self.owners;
             return out;
           }, "The occurrence latest in its sequence alone (the first of equals).")
      .def_static("of_tokens", [](const std::vector<py::object>& continuations, int match, double weight) {
             auto idx = std::make_shared<Index>();
             Matches m;
             m.match = match;
             for (const auto& c : continuations) {
               int32_t sid = int32_t(idx->seqs.size());
               idx->seqs.emplace_back();
               read_tokens(c, 0, idx->seqs.back());
               idx->weights.push_back(weight);
               idx->finals.push_back(1);
               m.occ.push_back({idx.get(), sid, 0});
             }
             m.owners.push_back(idx);
             return m;
           }, py::arg("continuations"), py::arg("match") = kMinMatch, py::arg("weight") = 1.0,
           "Matches whose continuations are the given token lists (for sources that pick their own).");

  mod.def("match_batch", [](const std::vector<py::object>& indices, const std::vector<py::object>& outputs,
                            const std::vector<py::object>& prompts, int max_match, int min_match) {
            if (indices.size() != outputs.size() || indices.size() != prompts.size())
              throw py::value_error("match_batch: indices, outputs and prompts differ in length");
            py::list out(indices.size());
            for (size_t i = 0; i < indices.size(); ++i) {
              if (indices[i].is_none()) {
                out[i] = py::none();
                continue;
              }
              auto idx = indices[i].cast<std::shared_ptr<Index>>();
              out[i] = match_one(idx, tail(outputs[i], prompts[i], size_t(max_match)), max_match, min_match);
            }
            return out;
          }, py::arg("indices"), py::arg("outputs"), py::arg("prompts"), py::arg("max_match"),
          py::arg("min_match") = kMinMatch,
          "Per row, the matches of the last max_match tokens of prompt + output in that row's index "
          "(None: no index, or no match).");

  mod.def("longest_match_drafts", [](const std::vector<py::list>& per_source, const std::vector<bool>& merge,
                                     const std::vector<bool>& fallback, const std::vector<py::object>& outputs,
                                     const std::vector<py::object>& prompts, const std::vector<int>& caps,
                                     int pattern_max, int pattern_min, double min_prob, int tree_budget,
                                     bool with_probs) {
            const size_t rows = caps.size();
            if (outputs.size() != rows || prompts.size() != rows || merge.size() != per_source.size() ||
                fallback.size() != per_source.size())
              throw py::value_error("longest_match_drafts: arguments differ in length");
            for (const auto& l : per_source)
              if (size_t(l.size()) != rows) throw py::value_error("longest_match_drafts: a source's list is not one per row");
            std::vector<CastCache> casts(per_source.size());
            Scratch sc;
            std::vector<int> winner(rows, -1);
            std::vector<size_t> offset(rows + 1, 0);
            std::vector<Tok> all_tok;  // every row's draft, one after another
            std::vector<int> all_par;
            std::vector<double> all_prob, all_sup;
            std::vector<double>* sup = with_probs ? &all_sup : nullptr;
            const bool tree = tree_budget > 0;
            size_t width = 0;
            for (size_t i = 0; i < rows; ++i) {
              offset[i] = all_tok.size();
              if (caps[i] <= 0) continue;
              int k = longest_match(per_source, merge, fallback, casts, i, outputs[i], prompts[i], pattern_max,
                                    pattern_min, sc);
              if (k < 0) continue;
              if (tree) {
                auto [t, p, q] = draft_tree(sc.best, std::min(tree_budget, std::max(caps[i], 1) * 2), caps[i], min_prob, sup);
                all_tok.insert(all_tok.end(), t.begin(), t.end());
                all_par.insert(all_par.end(), p.begin(), p.end());
                all_prob.insert(all_prob.end(), q.begin(), q.end());
              } else {
                draft_path_into(sc.best, caps[i], min_prob, sc, all_tok, all_prob, sup);
              }
              size_t n = all_tok.size() - offset[i];
              if (n == 0) continue;
              winner[i] = k;
              width = std::max(width, n);
            }
            offset[rows] = all_tok.size();
            // One padded array per field for the whole batch: the engine scores it as it is.
            const auto W = py::ssize_t(width), R = py::ssize_t(rows);
            py::array_t<int64_t> src(R), len(R), tok({R, W}), par({R, W}), dep({R, W});
            py::array_t<double> pr({R, with_probs ? W : py::ssize_t(0)}), su({R, with_probs ? W : py::ssize_t(0)});
            auto s_ = src.mutable_unchecked<1>();
            auto l_ = len.mutable_unchecked<1>();
            auto t_ = tok.mutable_unchecked<2>();
            auto p_ = par.mutable_unchecked<2>();
            auto d_ = dep.mutable_unchecked<2>();
            auto q_ = pr.mutable_unchecked<2>();
            auto u_ = su.mutable_unchecked<2>();
            for (py::ssize_t i = 0; i < R; ++i) {
              const size_t o = offset[size_t(i)];
              const py::ssize_t n = winner[size_t(i)] < 0 ? 0 : py::ssize_t(offset[size_t(i) + 1] - o);
              s_(i) = winner[size_t(i)];
              l_(i) = n;
              for (py::ssize_t j = 0; j < W; ++j) {
                bool on = j < n;
                t_(i, j) = on ? all_tok[o + size_t(j)] : -1;
                int parent = !on ? -1 : tree ? all_par[o + size_t(j)] : int(j) - 1;
                p_(i, j) = parent;
                d_(i, j) = !on ? 0 : parent < 0 ? 1 : d_(i, parent) + 1;
                if (with_probs) {
                  q_(i, j) = on ? all_prob[o + size_t(j)] : 0.0;
                  u_(i, j) = on ? all_sup[o + size_t(j)] : 0.0;
                }
              }
            }
            const py::object none = py::none();
            return py::make_tuple(src, len, tok, par, dep, with_probs ? py::object(pr) : none,
                                  with_probs ? py::object(su) : none);
          }, py::arg("per_source"), py::arg("merge"), py::arg("fallback"), py::arg("outputs"), py::arg("prompts"),
          py::arg("caps"), py::arg("pattern_max"), py::arg("pattern_min"), py::arg("min_prob"), py::arg("tree_budget"),
          py::arg("with_probs") = true,
          "The longest-match rule and the drafts, for a batch: per_source[k][i] is the index source k "
          "matches row i's context in, or the Matches it found itself, or None; rows with caps[i] <= 0 "
          "are not drafted. Returns numpy arrays (source [R] (-1: no draft), lengths [R], tokens, parents, "
          "depths [R, W], node probabilities [R, W] and supports [R, W] (the weight of the continuations "
          "seen at each node's context), both None without with_probs), W the longest draft; past a "
          "row's length: token -1, parent -1, depth 0, probability and support 0.");

  mod.def("draft_paths", [](const std::vector<const Matches*>& matches, const std::vector<int>& caps, double min_prob) {
            if (matches.size() != caps.size()) throw py::value_error("draft_paths: matches and caps differ in length");
            std::vector<std::pair<std::vector<Tok>, std::vector<double>>> out;
            out.reserve(matches.size());
            for (size_t i = 0; i < matches.size(); ++i) out.push_back(draft_path(*matches[i], caps[i], min_prob));
            return out;
          }, py::arg("matches"), py::arg("caps"), py::arg("min_prob"),
          "Per row, (tokens, probabilities) of the heaviest path, at most caps[i] long.");

  mod.def("draft_trees", [](const std::vector<const Matches*>& matches, const std::vector<int>& budgets,
                            const std::vector<int>& caps, double min_prob) {
            if (matches.size() != caps.size() || matches.size() != budgets.size())
              throw py::value_error("draft_trees: matches, budgets and caps differ in length");
            std::vector<std::tuple<std::vector<Tok>, std::vector<int>, std::vector<double>>> out;
            out.reserve(matches.size());
            for (size_t i = 0; i < matches.size(); ++i) out.push_back(draft_tree(matches[i]->occ, budgets[i], caps[i], min_prob));
            return out;
          }, py::arg("matches"), py::arg("budgets"), py::arg("caps"), py::arg("min_prob"),
          "Per row, (tokens, parents, probabilities) of a best-first tree of budgets[i] nodes, caps[i] deep.");
}
