#include "scheduler/state_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "common/error.h"

namespace april::sched {

namespace {

// Owns a file descriptor; closes it on every path out.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

[[noreturn]] void io_error(const std::string& what, const std::string& path) {
  throw Error(ErrorKind::Io, what + " " + path + ": " + std::strerror(errno));
}

// Creates a temporary file next to path that no other writer uses: the pid tells processes apart, the
// counter calls within one; O_EXCL skips a name left behind by a crashed writer.
Fd create_temporary(const std::string& path, std::string& tmp) {
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0;; ++attempt) {
    tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
    Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (fd.get() >= 0) return Fd(fd.release());
    if (errno != EEXIST || attempt >= 100) io_error("cannot create", tmp);
  }
}

void write_all(int fd, const std::string& bytes, const std::string& tmp) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) io_error("cannot write", tmp);
    done += static_cast<size_t>(w);
  }
}

// Removes the temporary file unless the rename consumed it.
class TemporaryFile {
 public:
  explicit TemporaryFile(const std::string& name) : name_(name) {}
  ~TemporaryFile() {
    if (!name_.empty()) ::unlink(name_.c_str());
  }
  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;
  void renamed() { name_.clear(); }

 private:
  std::string name_;
};

}  // namespace

void write_file_atomic(const std::string& path, const std::string& bytes) {
  std::string tmp;
  Fd fd = create_temporary(path, tmp);
  TemporaryFile cleanup(tmp);
  write_all(fd.get(), bytes, tmp);
  if (::fsync(fd.get()) != 0) io_error("cannot fsync", tmp);
  if (::close(fd.release()) != 0) io_error("cannot close", tmp);
  if (::rename(tmp.c_str(), path.c_str()) != 0) io_error("cannot rename " + tmp + " to", path);
  cleanup.renamed();
  // The rename is durable only once the folder's entry is on disk.
  const auto slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  Fd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.get() < 0) io_error("cannot open the folder of", path);
  // EINVAL: a file system that cannot sync folders; the rename is as durable as it gets there.
  if (::fsync(dfd.get()) != 0 && errno != EINVAL) io_error("cannot fsync the folder of", path);
}

std::string read_file(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) io_error("cannot open", path);
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t r = ::read(fd.get(), buf, sizeof(buf));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) io_error("cannot read", path);
    if (r == 0) break;
    out.append(buf, static_cast<size_t>(r));
  }
  return out;
}

}  // namespace april::sched
