/* Fast index builders for the GPT and blended datasets (pybind11, no torch).
 *
 * build_sample_idx        : where each GPT sample starts, as (index into doc_idx, token offset).
 * build_blending_indices  : which dataset, and which of its samples, each blended sample reads.
 *
 * Both reproduce the algorithms of Megatron-LM / Megatron-DeepSpeed bit for bit, so cached
 * indices and sample order match theirs. megatron/data/helpers.py holds a numpy fallback with
 * identical output and documents the semantics.
 */

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

int64_t num_samples_for(int64_t total_tokens, int64_t seq_length, int64_t extra,
                        bool drop_last) {
  const int64_t usable = total_tokens - extra;
  if (usable <= 0) return 0;
  if (drop_last) return usable / seq_length;
  return (usable + seq_length - 1) / seq_length;
}

/* Walks the documents of doc_idx in order, cutting a sample of seq_length + extra tokens each
 * time; consecutive samples share `extra` tokens (the label of the last position). */
template <typename Out, typename DocIdx>
py::array_t<Out> sample_idx_impl(const py::array_t<int32_t, py::array::c_style>& sizes_,
                                 const py::array_t<DocIdx, py::array::c_style>& doc_idx_,
                                 int32_t seq_length, int32_t num_epochs,
                                 int64_t tokens_per_epoch, bool drop_last, int32_t extra) {
  if (seq_length < 1) throw std::invalid_argument("build_sample_idx: seq_length must be >= 1");
  if (extra < 0) throw std::invalid_argument("build_sample_idx: add_extra_token must be >= 0");
  const int32_t* sizes = sizes_.data();
  const DocIdx* doc_idx = doc_idx_.data();
  const int64_t n_sizes = sizes_.shape(0);
  const int64_t n_docs = doc_idx_.shape(0);
  for (int64_t i = 0; i < n_docs; ++i) {
    if (doc_idx[i] < 0 || doc_idx[i] >= n_sizes)
      throw std::out_of_range("build_sample_idx: doc_idx[" + std::to_string(i) + "] = " +
                              std::to_string(static_cast<int64_t>(doc_idx[i])) +
                              " is outside sizes of length " + std::to_string(n_sizes));
  }
  const int64_t num_samples = num_samples_for(static_cast<int64_t>(num_epochs) * tokens_per_epoch,
                                              seq_length, extra, drop_last);
  if (num_samples > 0 && n_docs == 0)
    throw std::invalid_argument("build_sample_idx: empty doc_idx");

  py::array_t<Out> result({num_samples + 1, static_cast<int64_t>(2)});
  Out* out = result.mutable_data();
  bool ran_out = false;
  {
    py::gil_scoped_release release;
    int64_t doc_pos = 0;     // index into doc_idx
    int64_t doc_offset = 0;  // first token of the next sample inside that document
    out[0] = 0;
    out[1] = 0;
    for (int64_t sample = 1; sample <= num_samples && !ran_out; ++sample) {
      int64_t remaining = static_cast<int64_t>(seq_length) + extra;
      while (remaining != 0) {
        const int64_t doc_length = static_cast<int64_t>(sizes[doc_idx[doc_pos]]) - doc_offset;
        remaining -= doc_length;
        if (remaining <= 0) {
          // The sample ends inside this document; the next one starts `extra` tokens earlier.
          doc_offset += remaining + doc_length - extra;
          remaining = 0;
        } else if (doc_pos == n_docs - 1) {
          // Only reachable when the last partial sample is kept.
          doc_offset = static_cast<int64_t>(sizes[doc_idx[doc_pos]]) - extra;
          if (sample != num_samples) ran_out = true;
          break;
        } else {
          ++doc_pos;
          doc_offset = 0;
        }
      }
      out[2 * sample] = static_cast<Out>(doc_pos);
      out[2 * sample + 1] = static_cast<Out>(doc_offset);
    }
  }
  if (ran_out)
    throw std::runtime_error("build_sample_idx: tokens_per_epoch is larger than the documents "
                             "in doc_idx hold");
  return result;
}

template <typename Out>
void register_sample_idx(py::module_& m, const char* name) {
  const char* doc =
      "build_sample_idx(sizes: int32[n], doc_idx: int32|int64[m], seq_length, num_epochs, "
      "tokens_per_epoch, drop_last_partial_sequence=True, add_extra_token=1) -> [samples+1, 2]";
  m.def(name, &sample_idx_impl<Out, int32_t>, doc, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        py::arg("drop_last_partial_sequence") = true, py::arg("add_extra_token") = 1);
  m.def(name, &sample_idx_impl<Out, int64_t>, doc, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        py::arg("drop_last_partial_sequence") = true, py::arg("add_extra_token") = 1);
}

/* Megatron's greedy blend: sample i goes to the dataset whose share lags its weight most,
 * i.e. argmax_d (w_d * max(i, 1) - taken_d), ties to the lowest d. */
template <typename Index>
void blending_impl(Index* dataset_index, int64_t* dataset_sample_index, const double* weights,
                   int32_t num_datasets, int64_t size, bool verbose) {
  std::vector<int64_t> taken(num_datasets, 0);
  {
    py::gil_scoped_release release;
    for (int64_t i = 0; i < size; ++i) {
      const double position = std::max(static_cast<double>(i), 1.0);
      int32_t best = 0;
      double best_error = weights[0] * position - static_cast<double>(taken[0]);
      for (int32_t d = 1; d < num_datasets; ++d) {
        const double error = weights[d] * position - static_cast<double>(taken[d]);
        if (error > best_error) {
          best_error = error;
          best = d;
        }
      }
      dataset_index[i] = static_cast<Index>(best);
      dataset_sample_index[i] = taken[best];
      ++taken[best];
    }
  }
  if (verbose) {
    std::cout << " > blending " << size << " samples, sample ratios:" << std::endl;
    for (int32_t d = 0; d < num_datasets; ++d) {
      const double achieved = size ? static_cast<double>(taken[d]) / size : 0.0;
      std::cout << "   dataset " << d << ", weight: " << weights[d] << ", achieved: " << achieved
                << std::endl;
    }
  }
}

void check_output(const py::array& a, const char* name, int64_t size) {
  // Outputs are written in place, so a converted copy would silently lose the result.
  if (!(a.flags() & py::array::c_style) || !a.writeable())
    throw std::invalid_argument(std::string("build_blending_indices: ") + name +
                                " must be a writeable C-contiguous array");
  if (a.ndim() != 1 || a.shape(0) < size)
    throw std::invalid_argument(std::string("build_blending_indices: ") + name +
                                " must be 1-D with at least `size` entries");
}

void build_blending_indices(py::array dataset_index, py::array dataset_sample_index,
                            const py::array_t<double, py::array::c_style | py::array::forcecast>&
                                weights,
                            int32_t num_datasets, int64_t size, bool verbose) {
  if (num_datasets < 1) throw std::invalid_argument("build_blending_indices: no datasets");
  if (size < 0) throw std::invalid_argument("build_blending_indices: negative size");
  if (weights.shape(0) < num_datasets)
    throw std::invalid_argument("build_blending_indices: fewer weights than datasets");
  check_output(dataset_index, "dataset_index", size);
  check_output(dataset_sample_index, "dataset_sample_index", size);
  if (!dataset_sample_index.dtype().is(py::dtype::of<int64_t>()))
    throw std::invalid_argument("build_blending_indices: dataset_sample_index must be int64");
  auto* samples = static_cast<int64_t*>(dataset_sample_index.mutable_data());
  if (dataset_index.dtype().is(py::dtype::of<uint8_t>())) {
    if (num_datasets > 255) throw std::invalid_argument("uint8 dataset_index: > 255 datasets");
    blending_impl(static_cast<uint8_t*>(dataset_index.mutable_data()), samples, weights.data(),
                  num_datasets, size, verbose);
  } else if (dataset_index.dtype().is(py::dtype::of<int16_t>())) {
    if (num_datasets > 32767) throw std::invalid_argument("int16 dataset_index: too many datasets");
    blending_impl(static_cast<int16_t*>(dataset_index.mutable_data()), samples, weights.data(),
                  num_datasets, size, verbose);
  } else {
    throw std::invalid_argument("build_blending_indices: dataset_index must be uint8 or int16");
  }
}

}  // namespace

PYBIND11_MODULE(helpers_cpp, m) {
  m.doc() = "C++ index builders for megatron.data (see megatron/data/helpers.py)";
  register_sample_idx<int32_t>(m, "build_sample_idx");
  register_sample_idx<int64_t>(m, "build_sample_idx_int64");
  m.def("build_blending_indices", &build_blending_indices,
        "build_blending_indices(dataset_index: uint8|int16[size] (out), dataset_sample_index: "
        "int64[size] (out), weights: float64[num_datasets], num_datasets, size, verbose)",
        py::arg("dataset_index"), py::arg("dataset_sample_index"), py::arg("weights"),
        py::arg("num_datasets"), py::arg("size"), py::arg("verbose") = false);
}
