// The engine's host loops compiled (lookahead.host_loops builds this file; its docstring says what each does).
#include <Python.h>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int K = 8;  // ranks tabulated (RECYCLE_K)
constexpr int BITS = 21;  // RecycleTables' key packing
constexpr long long KEY_MAX = (1LL << BITS) - 2;  // the largest token id a packed key holds in 64 bits

// the edge model, set once by configure()
std::vector<double> edge;  // EDGE_PROBABILITY, by state code
long long ranked[4][K];  // _RANKED: the state code of rank r in a recycled list of each kind
double ranked_p[4][K];  // their probabilities
long long missing_code[4];  // _MISSING
long long no_recycle = 0;
std::vector<double> suffix_w, pool_w;  // SUFFIX_WEIGHTS, POOL_WEIGHTS
long long per_suffix = 1;  // _S
bool configured = false;

struct Cursor { int path; int i; };  // a proposed path at its token i
struct Proposal {  // a proposed path (its tokens read where a cursor reaches them: most never are)
  PyObject* fast; PyObject** items; Py_ssize_t size; int slot; long long first, later;
};
struct Entry { long long token; int below; long long state[3]; };  // state[1]: suffix, state[2]: pool
struct Child { double p; long long token; int below; };  // below: a cursor list, -1: none
struct Item {  // a heap entry: the sibling i of a list under `parent`
  double neg; long long order; int parent; long long parent_token, grand_token; double parent_score; int siblings;
  int i;
};
struct Later {  // the heap's order: the smallest (neg, order) on top, as Python's tuples compare
  bool operator()(const Item& a, const Item& b) const {
    return a.neg > b.neg || (a.neg == b.neg && a.order > b.order);
  }
};

struct Tables { PyObject* triples; PyObject* pairs; PyObject* single; };

// A recycled list's first K tokens into out, its length (for its truth) into size; false on a Python error.
bool read_list(PyObject* seq, long long* out, int* taken, Py_ssize_t* size) {
  if (PyList_CheckExact(seq) || PyTuple_CheckExact(seq)) {  // what the tables hold: read in place
    Py_ssize_t n = PyList_CheckExact(seq) ? PyList_GET_SIZE(seq) : PyTuple_GET_SIZE(seq);
    PyObject** items = PyList_CheckExact(seq) ? reinterpret_cast<PyListObject*>(seq)->ob_item
                                              : reinterpret_cast<PyTupleObject*>(seq)->ob_item;
    int m = static_cast<int>(std::min<Py_ssize_t>(n, K));
    for (int r = 0; r < m; ++r) {
      out[r] = PyLong_AsLongLong(items[r]);
      if (out[r] == -1 && PyErr_Occurred()) return false;
    }
    *taken = m;
    *size = n;
    return true;
  }
  PyObject* fast = PySequence_Fast(seq, "a recycled list must be a sequence");
  if (fast == nullptr) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  int m = static_cast<int>(std::min<Py_ssize_t>(n, K));
  for (int r = 0; r < m; ++r) {
    out[r] = PyLong_AsLongLong(items[r]);
    if (out[r] == -1 && PyErr_Occurred()) { Py_DECREF(fast); return false; }
  }
  Py_DECREF(fast);
  *taken = m;
  *size = n;
  return true;
}

// (hi + 1) << shift | low, as a Python int (RecycleTables' keys; Python arithmetic past 64 bits)
PyObject* packed(long long hi, int shift, PyObject* low) {
  PyObject* a = PyLong_FromLongLong(hi + 1);
  if (a == nullptr) return nullptr;
  PyObject* s = PyLong_FromLong(shift);
  PyObject* b = s == nullptr ? nullptr : PyNumber_Lshift(a, s);
  Py_DECREF(a);
  Py_XDECREF(s);
  if (b == nullptr) return nullptr;
  PyObject* c = PyNumber_Or(b, low);
  Py_DECREF(b);
  return c;
}

// The recycled tables' keys of a row: (previous + 1) << 21 | (token + 1) and (second + 1) << 42 | that (new refs).
bool row_keys(long long second, long long previous, long long token, PyObject** pair, PyObject** triple) {
  if (second >= -1 && second <= KEY_MAX && previous >= -1 && previous <= KEY_MAX && token >= -1 && token <= KEY_MAX) {
    long long p = ((previous + 1) << BITS) | (token + 1);
    *pair = PyLong_FromLongLong(p);
    *triple = PyLong_FromLongLong(((second + 1) << (2 * BITS)) | p);
  } else {
    PyObject* low = PyLong_FromLongLong(token + 1);
    *pair = low == nullptr ? nullptr : packed(previous, BITS, low);
    Py_XDECREF(low);
    *triple = *pair == nullptr ? nullptr : packed(second, 2 * BITS, *pair);
  }
  if (*pair == nullptr || *triple == nullptr) {
    Py_XDECREF(*pair);
    Py_XDECREF(*triple);
    return false;
  }
  return true;
}

// RecycleTables.lookup: the context list (triple, else pair) into *found, else the token's list into *single (either
// may stay null: not there). Borrowed references. False on a Python error.
bool lookup(const Tables& t, long long second, long long previous, long long token, PyObject** found,
            PyObject** single) {
  *found = *single = nullptr;
  PyObject *pair, *triple;
  if (!row_keys(second, previous, token, &pair, &triple)) return false;
  *found = PyDict_GetItemWithError(t.triples, triple);
  Py_DECREF(triple);
  if (*found == nullptr && !PyErr_Occurred()) *found = PyDict_GetItemWithError(t.pairs, pair);
  Py_DECREF(pair);
  if (PyErr_Occurred()) return false;
  if (*found != nullptr) return true;
  PyObject* key = PyLong_FromLongLong(token);
  if (key == nullptr) return false;
  *single = PyDict_GetItemWithError(t.single, key);
  Py_DECREF(key);
  return !PyErr_Occurred();
}

class Grower {
 public:
  Grower(const Tables* own, const Tables* memory) : own_(own), memory_(memory) {}
  ~Grower() { for (Proposal& p : proposals) Py_DECREF(p.fast); }

  std::vector<Proposal> proposals;
  std::vector<std::vector<Cursor>> lists;  // cursor lists: what a node's children are proposed from
  std::vector<Child> arena;  // every sibling list, one after another
  std::vector<std::pair<int, int>> siblings;  // a sibling list: its start in `arena` and its size

  // DraftBuilder._recycled: the list under token and its kind; false on a Python error
  bool recycled(long long second, long long previous, long long token, long long* listed, int* taken,
                Py_ssize_t* size, int* kind) {
    *taken = 0; *size = 0; *kind = 1;
    if (own_ == nullptr) return true;  // no recycling: ((), 1)
    PyObject *found, *single;
    if (!lookup(*own_, second, previous, token, &found, &single)) return false;
    if (found != nullptr) { *kind = 0; return read_list(found, listed, taken, size); }
    if (single != nullptr && !read_list(single, listed, taken, size)) return false;
    if (*size > 0 || memory_ == nullptr) { *kind = 1; return true; }
    if (!lookup(*memory_, second, previous, token, &found, &single)) return false;
    if (found != nullptr) { *kind = 2; return read_list(found, listed, taken, size); }
    *kind = 3;
    return single == nullptr || read_list(single, listed, taken, size);
  }

  // _expand: one level of the proposal trie under the cursors of list `below`; false on a Python error
  bool expand(int below, std::vector<Entry>* level) {
    for (size_t n = 0; n < lists[below].size(); ++n) {  // (by index: the loop grows `lists`)
      const Cursor c = lists[below][n];
      const Proposal& path = proposals[c.path];
      long long token = PyLong_AsLongLong(path.items[c.i]), state = c.i == 0 ? path.first : path.later;
      if (token == -1 && PyErr_Occurred()) return false;
      Entry* entry = nullptr;
      for (Entry& e : *level) if (e.token == token) { entry = &e; break; }
      if (entry == nullptr) {
        level->push_back(Entry{token, -1, {0, 0, 0}});
        entry = &level->back();
        entry->state[path.slot] = state;
      } else if (stronger(path.slot, state, entry->state[path.slot])) {
        entry->state[path.slot] = state;
      }
      if (c.i + 1 < path.size) {
        if (entry->below < 0) { entry->below = static_cast<int>(lists.size()); lists.emplace_back(); }
        lists[entry->below].push_back(Cursor{c.path, c.i + 1});
      }
    }
    return true;
  }

  // DraftBuilder._children: the children offered under token, best first, as a new sibling list (its index); -1 on
  // a Python error
  int children(long long second, long long previous, long long token, int below) {
    long long listed[K];
    int taken;
    Py_ssize_t size;
    int kind;
    if (!recycled(second, previous, token, listed, &taken, &size, &kind)) return -1;
    std::vector<Entry>& level = level_;
    level.clear();
    if (below >= 0 && !expand(below, &level)) return -1;
    std::vector<Child>& out = out_;
    out.clear();
    if (level.empty()) {
      for (int r = 0; r < taken; ++r) out.push_back(Child{ranked_p[kind][r], listed[r], -1});
    } else {
      std::vector<long long>& codes = codes_;
      codes.clear();
      for (int r = 0; r < taken; ++r) {  // dict(zip(listed, ranked)): a repeated token keeps its last rank's code
        int at = -1;
        for (int j = 0; j < static_cast<int>(out.size()); ++j) if (out[j].token == listed[r]) { at = j; break; }
        if (at < 0) { out.push_back(Child{0.0, listed[r], -1}); codes.push_back(ranked[kind][r]); }
        else codes[at] = ranked[kind][r];
      }
      long long missing = size > 0 ? missing_code[kind] : no_recycle;
      for (const Entry& e : level) {
        int at = -1;
        for (int j = 0; j < static_cast<int>(out.size()); ++j) if (out[j].token == e.token) { at = j; break; }
        if (at < 0) { out.push_back(Child{0.0, e.token, e.below}); codes.push_back(missing + e.state[1] + e.state[2]); }
        else { out[at].below = e.below; codes[at] += e.state[1] + e.state[2]; }
      }
      for (size_t j = 0; j < out.size(); ++j) out[j].p = edge.at(static_cast<size_t>(codes[j]));
    }
    // out.sort(reverse=True) on (p, token, ...): siblings' tokens are distinct where it matters; a stable sort keeps
    // equal ones (a repeated recycled token) in order, as Python's does (an insertion sort: a few children)
    for (size_t j = 1; j < out.size(); ++j) {
      Child c = out[j];
      size_t at = j;
      while (at > 0 && (c.p > out[at - 1].p || (c.p == out[at - 1].p && c.token > out[at - 1].token))) {
        out[at] = out[at - 1];
        --at;
      }
      out[at] = c;
    }
    siblings.emplace_back(static_cast<int>(arena.size()), static_cast<int>(out.size()));
    arena.insert(arena.end(), out.begin(), out.end());
    return static_cast<int>(siblings.size()) - 1;
  }

  const Child& sibling(int list, int i) const { return arena[siblings[list].first + i]; }
  int count(int list) const { return siblings[list].second; }

 private:
  static bool stronger(int slot, long long state, long long than) {
    if (slot == 1) return suffix_w.at(state / per_suffix) > suffix_w.at(than / per_suffix);
    return pool_w.at(state) > pool_w.at(than);
  }

  const Tables* own_;
  const Tables* memory_;
  std::vector<Entry> level_;  // scratch of `children`
  std::vector<Child> out_;
  std::vector<long long> codes_;
};

bool tables_of(PyObject* obj, Tables* t) {
  if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 3) {
    PyErr_SetString(PyExc_TypeError, "tables must be (triples, pairs, single) dicts");
    return false;
  }
  t->triples = PyTuple_GET_ITEM(obj, 0);
  t->pairs = PyTuple_GET_ITEM(obj, 1);
  t->single = PyTuple_GET_ITEM(obj, 2);
  if (!PyDict_Check(t->triples) || !PyDict_Check(t->pairs) || !PyDict_Check(t->single)) {
    PyErr_SetString(PyExc_TypeError, "tables must be (triples, pairs, single) dicts");
    return false;
  }
  return true;
}

bool doubles(PyObject* seq, std::vector<double>* out) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of floats");
  if (fast == nullptr) return false;
  out->clear();
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    out->push_back(PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, i)));
  }
  Py_DECREF(fast);
  return !PyErr_Occurred();
}

bool longs(PyObject* seq, long long* out, Py_ssize_t n) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of ints");
  if (fast == nullptr) return false;
  if (PySequence_Fast_GET_SIZE(fast) != n) {
    Py_DECREF(fast);
    PyErr_Format(PyExc_ValueError, "expected %zd ints", n);
    return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
  Py_DECREF(fast);
  return !PyErr_Occurred();
}

// configure(edge_probability, ranked [4][K], missing [4], no_recycle, suffix_weights, pool_weights, per_suffix)
PyObject* configure(PyObject*, PyObject* args) {
  PyObject *e, *r, *m, *sw, *pw;
  if (!PyArg_ParseTuple(args, "OOOLOOL", &e, &r, &m, &no_recycle, &sw, &pw, &per_suffix)) return nullptr;
  if (!doubles(e, &edge) || !doubles(sw, &suffix_w) || !doubles(pw, &pool_w) || !longs(m, missing_code, 4)) {
    return nullptr;
  }
  PyObject* rows = PySequence_Fast(r, "ranked must be a sequence");
  if (rows == nullptr) return nullptr;
  if (PySequence_Fast_GET_SIZE(rows) != 4) {
    Py_DECREF(rows);
    PyErr_SetString(PyExc_ValueError, "ranked must have 4 rows");
    return nullptr;
  }
  for (int k = 0; k < 4; ++k) {
    if (!longs(PySequence_Fast_GET_ITEM(rows, k), ranked[k], K)) { Py_DECREF(rows); return nullptr; }
    for (int j = 0; j < K; ++j) ranked_p[k][j] = edge.at(static_cast<size_t>(ranked[k][j]));
  }
  Py_DECREF(rows);
  configured = true;
  Py_RETURN_NONE;
}

// grow(second, previous, root_token, proposals, budget, own tables or None, memory tables or None)
//   -> (tokens, parents, scores): DraftBuilder._grow_python's
PyObject* grow(PyObject*, PyObject* args) {
  long long second, previous, root_token;
  Py_ssize_t budget;
  PyObject *props, *own_obj, *memory_obj;
  if (!PyArg_ParseTuple(args, "LLLOnOO", &second, &previous, &root_token, &props, &budget, &own_obj, &memory_obj)) {
    return nullptr;
  }
  if (!configured) {
    PyErr_SetString(PyExc_RuntimeError, "configure() first");
    return nullptr;
  }
  Tables own, memory;
  if (own_obj != Py_None && !tables_of(own_obj, &own)) return nullptr;
  if (memory_obj != Py_None && !tables_of(memory_obj, &memory)) return nullptr;
  Grower g(own_obj == Py_None ? nullptr : &own, memory_obj == Py_None ? nullptr : &memory);

  // the proposals: (path, 0, slot, first state, later state)
  PyObject* fast = PySequence_Fast(props, "proposals must be a sequence");
  if (fast == nullptr) return nullptr;
  std::vector<Cursor> roots;
  for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(fast); ++j) {
    PyObject* item = PySequence_Fast_GET_ITEM(fast, j);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 5) {
      Py_DECREF(fast);
      PyErr_SetString(PyExc_TypeError, "a proposal must be a tuple (path, index, slot, first state, later state)");
      return nullptr;
    }
    Proposal p;
    long long start = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 1));
    p.slot = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(item, 2)));
    p.first = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 3));
    p.later = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 4));
    if (PyErr_Occurred()) { Py_DECREF(fast); return nullptr; }
    p.fast = PySequence_Fast(PyTuple_GET_ITEM(item, 0), "a proposed path must be a sequence");
    if (p.fast == nullptr) { Py_DECREF(fast); return nullptr; }
    p.items = PySequence_Fast_ITEMS(p.fast);
    p.size = PySequence_Fast_GET_SIZE(p.fast);
    g.proposals.push_back(p);  // (the grower releases its path)
    if (p.slot != 1 && p.slot != 2) {
      Py_DECREF(fast);
      PyErr_SetString(PyExc_ValueError, "slot must be 1 or 2");
      return nullptr;
    }
    if (start < 0 || start >= p.size) {
      Py_DECREF(fast);
      PyErr_SetString(PyExc_IndexError, "a proposal's cursor is past its path");
      return nullptr;
    }
    roots.push_back(Cursor{static_cast<int>(g.proposals.size()) - 1, static_cast<int>(start)});
  }
  Py_DECREF(fast);

  std::vector<long long> tokens;
  std::vector<int> parents;
  std::vector<double> scores;
  std::vector<Item> heap;
  size_t most = static_cast<size_t>(std::max<Py_ssize_t>(std::min<Py_ssize_t>(budget, 4096), 0));
  tokens.reserve(most);  // (sized once: a node costs no reallocation)
  parents.reserve(most);
  scores.reserve(most);
  heap.reserve(2 * most + 2);
  g.siblings.reserve(most + 1);
  g.arena.reserve((most + 1) * K);
  int root_below = -1;
  if (!roots.empty()) { root_below = 0; g.lists.push_back(roots); }
  int offered = g.children(second, previous, root_token, root_below);
  if (offered < 0) return nullptr;
  if (g.count(offered) > 0) {
    heap.push_back(Item{-g.sibling(offered, 0).p, 0, -1, root_token, previous, 1.0, offered, 0});
  }
  long long order = 1;
  while (!heap.empty() && static_cast<Py_ssize_t>(tokens.size()) < budget) {
    std::pop_heap(heap.begin(), heap.end(), Later());
    Item it = heap.back();
    heap.pop_back();
    const Child child = g.sibling(it.siblings, it.i);
    int node = static_cast<int>(tokens.size());
    tokens.push_back(child.token);
    parents.push_back(it.parent);
    scores.push_back(-it.neg);
    if (it.i + 1 < g.count(it.siblings)) {
      double p = g.sibling(it.siblings, it.i + 1).p;
      heap.push_back(Item{-it.parent_score * p, order++, it.parent, it.parent_token, it.grand_token, it.parent_score,
                          it.siblings, it.i + 1});
      std::push_heap(heap.begin(), heap.end(), Later());
    }
    offered = g.children(it.grand_token, it.parent_token, child.token, child.below);
    if (offered < 0) return nullptr;
    if (g.count(offered) > 0) {
      heap.push_back(Item{it.neg * g.sibling(offered, 0).p, order++, node, child.token, it.parent_token, -it.neg,
                          offered, 0});
      std::push_heap(heap.begin(), heap.end(), Later());
    }
  }

  Py_ssize_t n = static_cast<Py_ssize_t>(tokens.size());
  PyObject* out_tokens = PyList_New(n);
  PyObject* out_parents = PyList_New(n);
  PyObject* out_scores = PyList_New(n);
  if (out_tokens == nullptr || out_parents == nullptr || out_scores == nullptr) goto fail;
  for (Py_ssize_t j = 0; j < n; ++j) {
    PyObject* a = PyLong_FromLongLong(tokens[j]);
    PyObject* b = PyLong_FromLong(parents[j]);
    PyObject* c = PyFloat_FromDouble(scores[j]);
    if (a == nullptr || b == nullptr || c == nullptr) { Py_XDECREF(a); Py_XDECREF(b); Py_XDECREF(c); goto fail; }
    PyList_SET_ITEM(out_tokens, j, a);
    PyList_SET_ITEM(out_parents, j, b);
    PyList_SET_ITEM(out_scores, j, c);
  }
  return Py_BuildValue("(NNN)", out_tokens, out_parents, out_scores);
fail:
  Py_XDECREF(out_tokens);
  Py_XDECREF(out_parents);
  Py_XDECREF(out_scores);
  return nullptr;
}

// One index of a Python list extended by `extra` values (negative: from the end, as Python indexes); false with an
// IndexError past either end.
bool extended_at(PyObject* fast, const long long* extra, Py_ssize_t extras, long long i, long long* out) {
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast) + extras;
  if (i < 0) i += n;
  if (i < 0 || i >= n) {
    PyErr_SetString(PyExc_IndexError, "a step index out of the layout");
    return false;
  }
  Py_ssize_t own = PySequence_Fast_GET_SIZE(fast);
  if (i >= own) { *out = extra[i - own]; return true; }
  *out = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
  return !(*out == -1 && PyErr_Occurred());
}

// learn(triples, pairs, single, rows, parents, tokens, before_second, before_last, topk [T, k] int64 buffer):
// RecycleTables.update_step_python's, in place: each row's top-k list (one list per step index, shared by the keys
// that take it) under its triple, pair and token, rows in order (a later row wins).
PyObject* learn(PyObject*, PyObject* args) {
  PyObject *triples, *pairs, *single, *rows_obj, *parents_obj, *tokens_obj, *topk_obj;
  long long extra_tokens[2];
  const long long extra_parent[1] = {-2};  // the input token's predecessor (-1) is preceded by -2
  if (!PyArg_ParseTuple(args, "O!O!O!OOOLLO", &PyDict_Type, &triples, &PyDict_Type, &pairs, &PyDict_Type, &single,
                        &rows_obj, &parents_obj, &tokens_obj, &extra_tokens[0], &extra_tokens[1], &topk_obj)) {
    return nullptr;
  }
  Py_buffer view;
  if (PyObject_GetBuffer(topk_obj, &view, PyBUF_STRIDES | PyBUF_FORMAT) != 0) return nullptr;
  bool ok = view.ndim == 2 && view.itemsize == 8 && view.format != nullptr &&
            (view.format[0] == 'l' || view.format[0] == 'q') && view.format[1] == 0;
  if (!ok) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_TypeError, "topk must be a 2-D int64 array");
    return nullptr;
  }
  PyObject* rows = PySequence_Fast(rows_obj, "rows must be a sequence");
  PyObject* parents = rows == nullptr ? nullptr : PySequence_Fast(parents_obj, "parents must be a sequence");
  PyObject* tokens = parents == nullptr ? nullptr : PySequence_Fast(tokens_obj, "tokens must be a sequence");
  std::vector<PyObject*> made(static_cast<size_t>(view.shape[0]), nullptr);  // each step index's list, once
  bool good = tokens != nullptr;
  const char* base = static_cast<const char*>(view.buf);
  for (Py_ssize_t j = 0; good && j < PySequence_Fast_GET_SIZE(rows); ++j) {
    long long i = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(rows, j));
    long long first, second, t_second, t_first, t_token;
    good = !(i == -1 && PyErr_Occurred()) && extended_at(parents, extra_parent, 1, i, &first) &&
           extended_at(parents, extra_parent, 1, first, &second) &&
           extended_at(tokens, extra_tokens, 2, second, &t_second) &&
           extended_at(tokens, extra_tokens, 2, first, &t_first) && extended_at(tokens, extra_tokens, 2, i, &t_token);
    if (!good) break;
    long long r = i < 0 ? i + view.shape[0] : i;
    if (r < 0 || r >= view.shape[0]) {
      PyErr_SetString(PyExc_IndexError, "a row past the top-k array");
      good = false;
      break;
    }
    PyObject* row = made[r];
    if (row == nullptr) {
      row = PyList_New(view.shape[1]);
      good = row != nullptr;
      for (Py_ssize_t c = 0; good && c < view.shape[1]; ++c) {
        long long v = *reinterpret_cast<const long long*>(base + r * view.strides[0] + c * view.strides[1]);
        PyObject* item = PyLong_FromLongLong(v);
        good = item != nullptr;
        if (good) PyList_SET_ITEM(row, c, item);
      }
      if (!good) { Py_XDECREF(row); break; }
      made[r] = row;
    }
    PyObject *pair, *triple, *key;
    if (!row_keys(t_second, t_first, t_token, &pair, &triple)) { good = false; break; }
    key = PyLong_FromLongLong(t_token);
    good = key != nullptr && PyDict_SetItem(triples, triple, row) == 0 && PyDict_SetItem(pairs, pair, row) == 0 &&
           PyDict_SetItem(single, key, row) == 0;
    Py_DECREF(pair);
    Py_DECREF(triple);
    Py_XDECREF(key);
  }
  for (PyObject* row : made) Py_XDECREF(row);
  Py_XDECREF(rows);
  Py_XDECREF(parents);
  Py_XDECREF(tokens);
  PyBuffer_Release(&view);
  if (!good) return nullptr;
  Py_RETURN_NONE;
}

// continuations(tokens, ends, start, max_match, reach, limit, length, tail or None, scan): SuffixIndex's
// continuations_python, over its own list and dict. A continuation is a span of `tokens` until output.
PyObject* continuations(PyObject*, PyObject* args) {
  PyObject *seq_obj, *ends, *tail_obj;
  long long start;
  Py_ssize_t max_match, reach, limit, length, scan;
  if (!PyArg_ParseTuple(args, "OO!LnnnnOn", &seq_obj, &PyDict_Type, &ends, &start, &max_match, &reach, &limit,
                        &length, &tail_obj, &scan)) {
    return nullptr;
  }
  PyObject* seq = PySequence_Fast(seq_obj, "tokens must be a sequence");
  if (seq == nullptr) return nullptr;
  PyObject* tail = seq;
  if (tail_obj == Py_None) Py_INCREF(seq);
  else tail = PySequence_Fast(tail_obj, "tail must be a sequence");
  if (tail == nullptr) { Py_DECREF(seq); return nullptr; }
  PyObject* out = PyList_New(0);
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), tail_n = PySequence_Fast_GET_SIZE(tail);
  PyObject** toks = PySequence_Fast_ITEMS(seq);
  PyObject** tail_items = PySequence_Fast_ITEMS(tail);
  Py_ssize_t longest;
  long long itself;
  bool has_itself = tail_obj == Py_None;
  if (has_itself) { longest = std::min<Py_ssize_t>(max_match, n - 1); itself = start + n - 1; }
  else { longest = std::min<Py_ssize_t>(max_match, tail_n); itself = 0; }
  bool good = out != nullptr;
  auto value = [&](Py_ssize_t j) {  // read where needed: the memory's index holds thousands of tokens
    long long v = PyLong_AsLongLong(toks[j]);
    if (v == -1 && PyErr_Occurred()) good = false;
    return v;
  };
  struct Span { Py_ssize_t begin, size; long long matched; };
  std::vector<Span> taken;
  std::vector<long long> used;
  auto same = [&](const Span& a, const Span& b) {
    if (a.size != b.size) return false;
    for (Py_ssize_t j = 0; j < a.size; ++j) if (value(a.begin + j) != value(b.begin + j)) return false;
    return true;
  };
  // take a span unless taken; true when the output is full
  auto take = [&](const Span& span) -> bool {
    for (const Span& t : taken) if (same(t, span)) return false;
    taken.push_back(span);
    PyObject* tuple = PyTuple_New(span.size);
    if (tuple == nullptr) { good = false; return true; }
    for (Py_ssize_t j = 0; j < span.size; ++j) {
      Py_INCREF(toks[span.begin + j]);
      PyTuple_SET_ITEM(tuple, j, toks[span.begin + j]);
    }
    PyObject* item = Py_BuildValue("(NL)", tuple, span.matched);
    if (item == nullptr || PyList_Append(out, item) != 0) { Py_XDECREF(item); good = false; return true; }
    Py_DECREF(item);
    return static_cast<Py_ssize_t>(taken.size()) == limit;
  };
  bool full = !good || limit <= 0 || length <= 0 || longest < 1;
  for (Py_ssize_t m = longest; !full && m >= 1; --m) {
    std::vector<Span> found;
    bool measured = m == max_match;
    PyObject* key = PyTuple_New(m);
    if (key == nullptr) { good = false; break; }
    for (Py_ssize_t j = 0; j < m; ++j) {
      PyObject* t = tail_items[tail_n - m + j];
      Py_INCREF(t);
      PyTuple_SET_ITEM(key, j, t);
    }
    PyObject* occurrences = PyDict_GetItemWithError(ends, key);
    Py_DECREF(key);
    if (occurrences == nullptr) {
      if (PyErr_Occurred()) { good = false; break; }
      continue;
    }
    PyObject* list = PySequence_Fast(occurrences, "occurrences must be a sequence");
    if (list == nullptr) { good = false; break; }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(list);
    Py_ssize_t first = std::max<Py_ssize_t>(count - scan * limit, 0);
    for (Py_ssize_t o = count - 1; !full && o >= first; --o) {
      long long end = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(list, o));
      if (end == -1 && PyErr_Occurred()) { good = false; full = true; break; }
      if ((has_itself && end == itself) || std::find(used.begin(), used.end(), end) != used.end()) continue;
      used.push_back(end);
      Py_ssize_t i = static_cast<Py_ssize_t>(end + 1 - start);
      Py_ssize_t stop = std::min<Py_ssize_t>(std::max<Py_ssize_t>(i, 0) + length, n);
      Py_ssize_t begin = std::min<Py_ssize_t>(std::max<Py_ssize_t>(i, 0), n), size = 0;
      while (begin + size < stop && value(begin + size) != -1) ++size;  // up to a SEPARATOR: the next text
      if (!good) { full = true; break; }
      if (size == 0) continue;
      Span span{begin, size, m};
      if (measured) {  // SuffixIndex._matched: measured back up to reach
        long long matched = m;
        Py_ssize_t most = std::min<Py_ssize_t>(std::min<Py_ssize_t>(reach, tail_n),
                                               static_cast<Py_ssize_t>(end + 1 - start));
        Py_ssize_t at = static_cast<Py_ssize_t>(end - start);
        while (matched < most) {
          long long want = PyLong_AsLongLong(tail_items[tail_n - 1 - matched]);
          if (want == -1 && PyErr_Occurred()) { good = false; full = true; break; }
          if (value(at - matched) != want) break;
          ++matched;
        }
        span.matched = matched;
        found.push_back(span);
      } else {
        full = take(span);
      }
    }
    Py_DECREF(list);
    // the measured ones longest first (a stable sort, as Python's)
    std::stable_sort(found.begin(), found.end(), [](const Span& a, const Span& b) { return a.matched > b.matched; });
    for (const Span& span : found) {
      if (full) break;
      full = take(span);
    }
  }
  Py_DECREF(seq);
  Py_DECREF(tail);
  if (!good) { Py_XDECREF(out); return nullptr; }
  return out;
}

// extend(tokens, ends, start, run, max_match, new): SuffixIndex.extend_python's, over its own list and dict; returns
// the run (tokens since the last separator) after them.
PyObject* extend(PyObject*, PyObject* args) {
  PyObject *seq, *ends, *new_obj;
  long long start;
  Py_ssize_t run, max_match;
  if (!PyArg_ParseTuple(args, "O!O!LnnO", &PyList_Type, &seq, &PyDict_Type, &ends, &start, &run, &max_match,
                        &new_obj)) {
    return nullptr;
  }
  PyObject* added = PySequence_Fast(new_obj, "tokens must be a sequence");
  if (added == nullptr) return nullptr;
  bool good = true;
  for (Py_ssize_t t = 0; good && t < PySequence_Fast_GET_SIZE(added); ++t) {
    PyObject* token = PySequence_Fast_GET_ITEM(added, t);
    long long value = PyLong_AsLongLong(token);
    if ((value == -1 && PyErr_Occurred()) || PyList_Append(seq, token) != 0) { good = false; break; }
    if (value == -1) { run = 0; continue; }  // a SEPARATOR: no m-gram crosses it
    ++run;
    Py_ssize_t i = PyList_GET_SIZE(seq);
    PyObject* end = PyLong_FromLongLong(start + i - 1);
    if (end == nullptr) { good = false; break; }
    for (Py_ssize_t m = 1; good && m <= std::min(max_match, run); ++m) {
      PyObject* key = PyTuple_New(m);
      if (key == nullptr) { good = false; break; }
      for (Py_ssize_t j = 0; j < m; ++j) {
        PyObject* item = PyList_GET_ITEM(seq, i - m + j);
        Py_INCREF(item);
        PyTuple_SET_ITEM(key, j, item);
      }
      PyObject* found = PyDict_GetItemWithError(ends, key);
      if (found != nullptr) {
        good = PyList_Append(found, end) == 0;
      } else if (PyErr_Occurred()) {
        good = false;
      } else {
        PyObject* list = PyList_New(1);
        good = list != nullptr;
        if (good) {
          Py_INCREF(end);
          PyList_SET_ITEM(list, 0, end);
          good = PyDict_SetItem(ends, key, list) == 0;
          Py_DECREF(list);
        }
      }
      Py_DECREF(key);
    }
    Py_DECREF(end);
  }
  Py_DECREF(added);
  if (!good) return nullptr;
  return PyLong_FromSsize_t(run);
}

// grown(tokens, parents) -> (tokens, parents, tree_end, depths) in pre-order: DraftTree.grown_python's (a parent must
// be ROOT, -1, or an earlier node: ValueError otherwise, with its message; depths a tuple).
PyObject* grown(PyObject*, PyObject* args) {
  PyObject *tokens_obj, *parents_obj;
  if (!PyArg_ParseTuple(args, "OO", &tokens_obj, &parents_obj)) return nullptr;
  PyObject* tokens = PySequence_Fast(tokens_obj, "tokens must be a sequence");
  if (tokens == nullptr) return nullptr;
  PyObject* parents_fast = PySequence_Fast(parents_obj, "parents must be a sequence");
  if (parents_fast == nullptr) { Py_DECREF(tokens); return nullptr; }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(parents_fast);
  std::vector<Py_ssize_t> parents(n), size(n, 1), place(n, 0), free_at(n, 0), depth(n, 0);
  bool good = PySequence_Fast_GET_SIZE(tokens) >= n;
  if (!good) PyErr_SetString(PyExc_IndexError, "fewer tokens than parents");
  for (Py_ssize_t j = 0; good && j < n; ++j) {
    long long p = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(parents_fast, j));
    if (p == -1 && PyErr_Occurred()) { good = false; break; }
    parents[j] = static_cast<Py_ssize_t>(p);
  }
  for (Py_ssize_t node = n - 1; good && node >= 0; --node) {  // from the last, as the Python loop checks them
    Py_ssize_t parent = parents[node];
    if (!(-1 <= parent && parent < node)) {
      PyErr_Format(PyExc_ValueError, "parents[%zd] = %zd: a parent must be ROOT or an earlier node", node, parent);
      good = false;
      break;
    }
    if (parent != -1) size[parent] += size[node];
  }
  PyObject *out_tokens = nullptr, *out_parents = nullptr, *out_ends = nullptr, *out_depths = nullptr;
  if (good) {
    Py_ssize_t root_free = 0;
    for (Py_ssize_t node = 0; node < n; ++node) {
      Py_ssize_t parent = parents[node], at;
      if (parent == -1) { at = root_free; root_free += size[node]; }
      else { at = free_at[parent]; free_at[parent] = at + size[node]; }
      place[node] = at;
      free_at[node] = at + 1;
      depth[node] = parent == -1 ? 1 : depth[parent] + 1;
    }
    out_tokens = PyList_New(n);
    out_parents = PyList_New(n);
    out_ends = PyList_New(n);
    out_depths = PyTuple_New(n);
    good = out_tokens != nullptr && out_parents != nullptr && out_ends != nullptr && out_depths != nullptr;
    for (Py_ssize_t node = 0; good && node < n; ++node) {
      Py_ssize_t at = place[node], parent = parents[node];
      PyObject* token = PySequence_Fast_GET_ITEM(tokens, node);
      PyObject* up = PyLong_FromSsize_t(parent == -1 ? -1 : place[parent]);
      PyObject* end = PyLong_FromSsize_t(at + size[node]);
      PyObject* deep = PyLong_FromSsize_t(depth[node]);
      if (up == nullptr || end == nullptr || deep == nullptr) {
        Py_XDECREF(up);
        Py_XDECREF(end);
        Py_XDECREF(deep);
        good = false;
        break;
      }
      Py_INCREF(token);
      PyList_SET_ITEM(out_tokens, at, token);
      PyList_SET_ITEM(out_parents, at, up);
      PyList_SET_ITEM(out_ends, at, end);
      PyTuple_SET_ITEM(out_depths, at, deep);
    }
  }
  Py_DECREF(tokens);
  Py_DECREF(parents_fast);
  if (!good) {
    Py_XDECREF(out_tokens);
    Py_XDECREF(out_parents);
    Py_XDECREF(out_ends);
    Py_XDECREF(out_depths);
    return nullptr;
  }
  return Py_BuildValue("(NNNN)", out_tokens, out_parents, out_ends, out_depths);
}

// slots(scores, bands, numerator, denominator) -> (order, gains): budget.merge_slots over each row's
// StepBudget._worths (each row's draft scores, best first, as calibrated worths of each further node), in one pass.
PyObject* slots(PyObject*, PyObject* args) {
  PyObject *scores_obj, *bands_obj, *num_obj, *den_obj;
  if (!PyArg_ParseTuple(args, "OOOO", &scores_obj, &bands_obj, &num_obj, &den_obj)) return nullptr;
  std::vector<double> bands, numerator, denominator;
  if (!doubles(bands_obj, &bands) || !doubles(num_obj, &numerator) || !doubles(den_obj, &denominator)) return nullptr;
  if (numerator.size() < bands.size() + 1 || denominator.size() < bands.size() + 1) {
    PyErr_SetString(PyExc_ValueError, "a calibration needs one band more than its bounds");
    return nullptr;
  }
  PyObject* rows = PySequence_Fast(scores_obj, "scores must be a sequence");
  if (rows == nullptr) return nullptr;
  Py_ssize_t n_rows = PySequence_Fast_GET_SIZE(rows);
  std::vector<double> worths;  // every row's, one after another
  std::vector<Py_ssize_t> first(n_rows + 1, 0);
  for (Py_ssize_t r = 0; r < n_rows; ++r) {
    PyObject* row = PySequence_Fast(PySequence_Fast_GET_ITEM(rows, r), "a row's scores must be a sequence");
    if (row == nullptr) { Py_DECREF(rows); return nullptr; }
    double total = 0.0, before = 0.0;
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(row); ++j) {
      double score = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(row, j));
      if (score == -1.0 && PyErr_Occurred()) { Py_DECREF(row); Py_DECREF(rows); return nullptr; }
      total += score;
      size_t band = std::upper_bound(bands.begin(), bands.end(), total) - bands.begin();  // bisect_right
      double now = total * numerator[band] / denominator[band];
      worths.push_back(now - before);
      before = now;
    }
    Py_DECREF(row);
    first[r + 1] = static_cast<Py_ssize_t>(worths.size());
  }
  Py_DECREF(rows);
  struct Run { double neg; Py_ssize_t row, start, end; };
  std::vector<Run> runs;
  for (Py_ssize_t r = 0; r < n_rows; ++r) {
    Py_ssize_t start = first[r], n = first[r + 1];
    while (start < n) {
      double head = worths[start];
      Py_ssize_t end = start + 1;
      while (end < n && worths[end] >= head) ++end;
      runs.push_back(Run{-head, r, start, end});
      start = end;
    }
  }
  std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) {  // as Python sorts (-head, row, start, end)
    if (a.neg != b.neg) return a.neg < b.neg;
    if (a.row != b.row) return a.row < b.row;
    return a.start < b.start;
  });
  Py_ssize_t total = static_cast<Py_ssize_t>(worths.size());
  PyObject* order = PyList_New(total);
  PyObject* gains = PyList_New(total);
  bool good = order != nullptr && gains != nullptr;
  Py_ssize_t at = 0;
  for (const Run& run : runs) {
    if (!good) break;
    PyObject* row = PyLong_FromSsize_t(run.row);
    if (row == nullptr) { good = false; break; }
    for (Py_ssize_t j = run.start; j < run.end; ++j, ++at) {
      PyObject* gain = PyFloat_FromDouble(worths[j]);
      if (gain == nullptr) { good = false; break; }
      Py_INCREF(row);
      PyList_SET_ITEM(order, at, row);
      PyList_SET_ITEM(gains, at, gain);
    }
    Py_DECREF(row);
  }
  if (!good) { Py_XDECREF(order); Py_XDECREF(gains); return nullptr; }
  return Py_BuildValue("(NN)", order, gains);
}

PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "Set the edge model's tables."},
    {"grow", grow, METH_VARARGS, "DraftBuilder._grow_python, compiled."},
    {"learn", learn, METH_VARARGS, "RecycleTables.update_step_python, compiled."},
    {"continuations", continuations, METH_VARARGS, "SuffixIndex.continuations_python, compiled."},
    {"extend", extend, METH_VARARGS, "SuffixIndex.extend_python, compiled."},
    {"grown", grown, METH_VARARGS, "DraftTree.grown_python, compiled."},
    {"slots", slots, METH_VARARGS, "budget.merge_slots of StepBudget._worths of each row, compiled."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

#define STRINGIFY_(x) #x
#define STRINGIFY(x) STRINGIFY_(x)
#define INIT_(name) PyInit_##name
#define INIT(name) INIT_(name)

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, STRINGIFY(TORCH_EXTENSION_NAME), nullptr, -1, methods,
                                  nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
