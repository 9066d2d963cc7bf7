// The compiled event loop of the rollout simulator (`simulator.py`): the same algorithm as its
// Python reference, `_events_reference`, operation for operation (the same heaps, the same
// floating-point expressions in the same order), so both give the same results to the bit;
// the tests hold them equal.
//
// Why compiled: `auto` placement simulates each candidate plan on two draws, and at 1,024
// workers (262,144 samples) one simulation took 2.6 s of Python, 21 of a step's 28 s of planning.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <stdexcept>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using i64 = int64_t;
constexpr double kInf = std::numeric_limits<double>::infinity();

template <class T>
struct MinHeap {  // heapq's order: the smallest first; ties only between equal elements
  std::vector<T> v;
  bool empty() const { return v.empty(); }
  const T& top() const { return v.front(); }
  void push(const T& x) {
    v.push_back(x);
    std::push_heap(v.begin(), v.end(), std::greater<T>());
  }
  T pop() {
    std::pop_heap(v.begin(), v.end(), std::greater<T>());
    T x = v.back();
    v.pop_back();
    return x;
  }
};

struct Worker {
  std::deque<i64> queue;
  MinHeap<std::pair<i64, i64>> running;  // (end counter, request)
  MinHeap<std::pair<double, i64>> due;   // (start counter + predicted length, request)
  i64 c = 0;
  double t = 0.0, busy = 0.0, done_at = 0.0;
  i64 version = 0;
  std::unordered_set<i64> removed;
  std::vector<double> spans;  // busy intervals, flattened (start, end)
  bool open = false;
  double open_at = 0.0;
  i64 size() const { return static_cast<i64>(running.v.size()) - static_cast<i64>(removed.size()); }
};

class Curve {  // StepCost.step_s, and np.interp over the same points
 public:
  Curve(std::vector<double> b, std::vector<double> s) : b_(std::move(b)), s_(std::move(s)) {
    if (b_.empty() || b_.size() != s_.size()) throw std::invalid_argument("cost curve: batch and seconds differ");
  }
  double step_s(i64 B) const {
    if (B <= 0) return 0.0;
    const size_t n = b_.size();
    if (n == 1) return s_[0];
    const double x = static_cast<double>(B);
    size_t i;
    if (x <= b_[0]) {
      i = 0;
    } else if (x >= b_[n - 1]) {
      i = n - 2;
    } else {
      i = static_cast<size_t>(std::lower_bound(b_.begin(), b_.end(), x) - b_.begin()) - 1;
    }
    const double b0 = b_[i], b1 = b_[i + 1], s0 = s_[i], s1 = s_[i + 1];
    return std::max(1e-9, s0 + (s1 - s0) * (x - b0) / (b1 - b0));
  }
  double interp(double x) const {  // numpy's arr_interp
    const size_t n = b_.size();
    if (n == 1) return s_[0];
    if (x < b_[0]) return s_[0];
    if (x >= b_[n - 1]) return s_[n - 1];
    const size_t j = static_cast<size_t>(std::upper_bound(b_.begin(), b_.end(), x) - b_.begin()) - 1;
    if (b_[j] == x) return s_[j];
    const double slope = (s_[j + 1] - s_[j]) / (b_[j + 1] - b_[j]);
    return slope * (x - b_[j]) + s_[j];
  }

 private:
  std::vector<double> b_, s_;
};

template <class T>
std::vector<T> to_vec(const py::array_t<T, py::array::c_style | py::array::forcecast>& a) {
  return std::vector<T>(a.data(), a.data() + a.size());
}

py::dict run_events(const py::array_t<i64, py::array::c_style | py::array::forcecast>& queue_offsets,
                    const py::array_t<i64, py::array::c_style | py::array::forcecast>& req_prompt_a,
                    const py::array_t<i64, py::array::c_style | py::array::forcecast>& req_len_a,
                    const py::array_t<double, py::array::c_style | py::array::forcecast>& pred_a,
                    const py::array_t<i64, py::array::c_style | py::array::forcecast>& plens_a,
                    const py::array_t<double, py::array::c_style | py::array::forcecast>& batch,
                    const py::array_t<double, py::array::c_style | py::array::forcecast>& seconds, double pre,
                    i64 max_num_seqs, bool migrate_on, double tail_fraction) {
  const std::vector<i64> offs = to_vec(queue_offsets), req_prompt = to_vec(req_prompt_a), req_len = to_vec(req_len_a),
                         plens = to_vec(plens_a);
  const std::vector<double> pred = to_vec(pred_a);
  const Curve cost(to_vec(batch), to_vec(seconds));
  const i64 R = static_cast<i64>(offs.size()) - 1;
  const i64 total = static_cast<i64>(req_prompt.size());
  std::vector<Worker> ws(static_cast<size_t>(R));
  for (i64 w = 0; w < R; ++w)
    for (i64 k = offs[w]; k < offs[w + 1]; ++k) ws[w].queue.push_back(k);
  MinHeap<std::pair<i64, i64>> by_queue;  // (-waiting, worker), lazily refreshed
  for (i64 w = 0; w < R; ++w)
    if (!ws[w].queue.empty()) by_queue.push({-static_cast<i64>(ws[w].queue.size()), w});
  std::vector<i64> start(total, 0);
  std::vector<char> done(total, 0);
  std::vector<double> finished_at(total, 0.0);
  i64 unfinished = total, waiting = total, migrations = 0, steals = 0;
  bool have_ninety = false;
  double ninety_at = 0.0;
  MinHeap<std::tuple<double, i64, i64>> events;  // (time, worker, version); version -1: a wake-up
  std::unordered_set<i64> waking;
  std::vector<double> A_c(R, 0.0), A_t(R, 0.0), A_B(R, 0.0), A_due(R, kInf);

  auto refresh = [&](i64 wi) {
    Worker& w = ws[wi];
    while (!w.due.empty() && (done[w.due.top().second] || w.removed.count(w.due.top().second))) w.due.pop();
    A_c[wi] = static_cast<double>(w.c);
    A_t[wi] = w.t;
    A_B[wi] = static_cast<double>(w.size());
    A_due[wi] = w.due.empty() ? kInf : w.due.top().first;
  };

  auto admit = [&](Worker& w) {
    i64 free = max_num_seqs - w.size();
    std::unordered_set<i64> seen;
    i64 prefill = 0;
    while (!w.queue.empty() && free > 0) {
      const i64 rid = w.queue.front();
      w.queue.pop_front();
      --waiting;
      const i64 p = req_prompt[rid];
      if (seen.insert(p).second) prefill += plens[p];
      start[rid] = w.c;
      w.running.push({w.c + req_len[rid], rid});
      w.due.push({static_cast<double>(w.c) + pred[p], rid});
      --free;
    }
    if (prefill) {
      w.t += static_cast<double>(prefill) * pre;
      w.busy += static_cast<double>(prefill) * pre;
    }
  };

  auto schedule = [&](i64 wi) {
    Worker& w = ws[wi];
    ++w.version;
    while (!w.running.empty() && w.removed.count(w.running.top().second)) w.removed.erase(w.running.pop().second);
    if (!w.running.empty()) {
      events.push({w.t + static_cast<double>(w.running.top().first - w.c) * cost.step_s(w.size()), wi, w.version});
    } else {
      w.done_at = w.t;
      if (w.open) {
        w.spans.push_back(w.open_at);
        w.spans.push_back(w.t);
        w.open = false;
      }
    }
    refresh(wi);
  };

  auto steal = [&](i64 wi, double now) -> bool {
    i64 victim = -1;
    while (!by_queue.empty()) {
      const auto [n, v] = by_queue.top();
      const i64 now_n = static_cast<i64>(ws[v].queue.size());
      if (now_n == -n) {
        victim = v;
        break;
      }
      by_queue.pop();
      if (now_n) by_queue.push({-now_n, v});
    }
    if (victim < 0) return false;
    Worker& thief = ws[wi];
    thief.queue.push_back(ws[victim].queue.back());  // the shortest waiting work
    ws[victim].queue.pop_back();
    by_queue.push({-static_cast<i64>(thief.queue.size()), wi});
    thief.t = std::max(thief.t, now);
    ++steals;
    return true;
  };

  auto migrate = [&](i64 wi, double now) -> bool {
    i64 j = 0;
    double best = -kInf;
    bool any = false;
    for (i64 i = 0; i < R; ++i) {
      double over = -kInf;
      if (A_B[i] >= 2 && i != wi) {
        const double steps = (now - A_t[i]) / cost.interp(std::max(A_B[i], 1.0));
        over = A_c[i] + steps - A_due[i];
      }
      if (!any || over > best) {  // np.argmax: the first of the largest
        best = over;
        j = i;
        any = true;
      }
    }
    if (!(best > 0)) {
      // Nothing is overdue yet: wake up when the first candidate will be.
      if (!waking.count(wi)) {
        bool eligible_any = false;
        double t_wake = kInf;
        for (i64 i = 0; i < R; ++i) {
          if (A_B[i] >= 2 && i != wi && std::isfinite(A_due[i])) {
            const double when = A_t[i] + (A_due[i] - A_c[i]) * cost.interp(std::max(A_B[i], 1.0)) + 1e-9;
            t_wake = eligible_any ? std::min(t_wake, when) : when;
            eligible_any = true;
          }
        }
        if (eligible_any && t_wake > now) {
          waking.insert(wi);
          events.push({t_wake, wi, -1});
        }
      }
      return false;
    }
    Worker& v = ws[j];
    const i64 Bv = v.size();
    const i64 d = std::min(static_cast<i64>((now - v.t) / cost.step_s(Bv)), v.running.top().first - v.c);
    v.c += d;
    v.t += static_cast<double>(d) * cost.step_s(Bv);
    v.busy += static_cast<double>(d) * cost.step_s(Bv);
    const i64 rid = v.due.pop().second;
    const i64 generated = v.c - start[rid];
    const double recompute = static_cast<double>(plens[req_prompt[rid]] + generated) * pre;
    if ((cost.step_s(Bv) - cost.step_s(1)) * static_cast<double>(generated) <= recompute) {
      v.due.push({kInf, rid});  // not worth it: never reconsidered
      refresh(j);
      return false;
    }
    v.removed.insert(rid);
    schedule(j);
    Worker& thief = ws[wi];
    thief.t = std::max(thief.t, now) + recompute;
    thief.busy += recompute;
    start[rid] = thief.c - generated;
    thief.running.push({thief.c + req_len[rid] - generated, rid});
    ++migrations;
    return true;
  };

  for (i64 wi = 0; wi < R; ++wi) {
    ws[wi].open = true;
    ws[wi].open_at = 0.0;
    admit(ws[wi]);
    schedule(wi);
  }
  std::vector<i64> idle;
  for (i64 wi = 0; wi < R; ++wi)
    if (ws[wi].running.empty()) idle.push_back(wi);
  double now = 0.0;
  while (true) {
    if (migrate_on && !idle.empty()) {
      std::vector<i64> still;
      for (size_t k = 0; k < idle.size(); ++k) {
        const i64 wi = idle[k];
        const double t_open = std::max(ws[wi].t, now);
        const bool took = (waiting > 0 && steal(wi, now)) ||
                          (static_cast<double>(unfinished) <= tail_fraction * static_cast<double>(total) &&
                           migrate(wi, now));
        if (took) {
          ws[wi].open = true;
          ws[wi].open_at = t_open;
          admit(ws[wi]);
          schedule(wi);
        } else if (waiting == 0) {
          // nothing to take now, and the candidates are the same for every idle worker
          still.insert(still.end(), idle.begin() + static_cast<long>(k), idle.end());
          break;
        } else {
          still.push_back(wi);
        }
      }
      idle.swap(still);
    }
    if (events.empty()) break;
    const auto [t_ev, wi, ver] = events.pop();
    Worker& w = ws[wi];
    if (ver == -1) {
      waking.erase(wi);
      now = std::max(now, t_ev);
      continue;
    }
    if (ver != w.version) continue;
    now = t_ev;
    w.busy += t_ev - w.t;
    w.c = w.running.top().first;
    w.t = t_ev;
    while (!w.running.empty() && w.running.top().first <= w.c) {
      const i64 rid = w.running.pop().second;
      auto it = w.removed.find(rid);
      if (it != w.removed.end()) {
        w.removed.erase(it);
        continue;
      }
      done[rid] = 1;
      finished_at[rid] = t_ev;
      --unfinished;
      if (!have_ninety && static_cast<double>(unfinished) <= 0.1 * static_cast<double>(total)) {
        have_ninety = true;
        ninety_at = t_ev;
      }
    }
    admit(w);
    schedule(wi);
    if (w.running.empty()) idle.push_back(wi);
  }
  std::vector<double> done_at(R), busy(R);
  py::list spans;
  for (i64 wi = 0; wi < R; ++wi) {
    done_at[wi] = ws[wi].done_at;
    busy[wi] = ws[wi].busy;
    py::list s;
    for (size_t k = 0; k + 1 < ws[wi].spans.size(); k += 2) s.append(py::make_tuple(ws[wi].spans[k], ws[wi].spans[k + 1]));
    spans.append(s);
  }
  py::dict out;
  out["done_at"] = done_at;
  out["busy"] = busy;
  out["finished_at"] = py::array_t<double>(static_cast<py::ssize_t>(finished_at.size()), finished_at.data());
  out["spans"] = spans;
  out["migrations"] = migrations;
  out["steals"] = steals;
  out["ninety_at"] = have_ninety ? py::object(py::float_(ninety_at)) : py::object(py::none());
  return out;
}

}  // namespace

PYBIND11_MODULE(_simulator_core, m) {
  m.doc() = "The rollout simulator's event loop (simulator._events_reference, compiled).";
  m.def("run_events", &run_events, py::arg("queue_offsets"), py::arg("req_prompt"), py::arg("req_len"),
        py::arg("pred"), py::arg("plens"), py::arg("batch"), py::arg("seconds"), py::arg("pre"),
        py::arg("max_num_seqs"), py::arg("migrate"), py::arg("tail_fraction"));
}
