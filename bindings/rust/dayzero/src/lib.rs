//! Safe Rust API over libdayzero (see `dayzero-sys` for the raw declarations).
//!
//! Handles free themselves on drop, and lifetimes keep the C API's order: a
//! [`KvArena`] borrows its [`Model`], a [`Session`] borrows its arena. Thread
//! safety follows the header: `Model`, [`Tokenizer`] and `KvArena` are `Send +
//! Sync` (immutable or internally synchronised); `Session` and [`Detokenizer`]
//! are `Send` but not `Sync` (one thread at a time per handle).
//!
//! The compiler holds these rules. A session cannot be shared between threads:
//! ```compile_fail
//! fn sync<T: Sync>() {}
//! sync::<dayzero::Session<'static>>();
//! ```
//! and a model cannot be dropped while an arena made from it lives:
//! ```compile_fail
//! let model = dayzero::Model::open("m", &Default::default()).unwrap();
//! let arena = dayzero::KvArena::new(&model, &Default::default()).unwrap();
//! drop(model);
//! drop(arena);
//! ```
#![doc = include_str!("../README.md")]

use std::ffi::{CStr, CString};
use std::fmt;
use std::marker::PhantomData;
use std::os::raw::{c_char, c_int, c_void};
use std::path::Path;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use dayzero_sys as sys;

/// A dz_status other than DZ_OK.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    InvalidArgument,
    Io,
    Format,
    Unsupported,
    OutOfMemory,
    KvFull,
    Cancelled,
    Device,
    NotFound,
    BufferTooSmall,
    Internal,
    /// A status this crate does not know (a newer library).
    Other(i32),
}

impl Status {
    fn from_c(st: sys::dz_status) -> Status {
        match st {
            sys::DZ_ERR_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::DZ_ERR_IO => Status::Io,
            sys::DZ_ERR_FORMAT => Status::Format,
            sys::DZ_ERR_UNSUPPORTED => Status::Unsupported,
            sys::DZ_ERR_OUT_OF_MEMORY => Status::OutOfMemory,
            sys::DZ_ERR_KV_FULL => Status::KvFull,
            sys::DZ_ERR_CANCELLED => Status::Cancelled,
            sys::DZ_ERR_DEVICE => Status::Device,
            sys::DZ_ERR_NOT_FOUND => Status::NotFound,
            sys::DZ_ERR_BUFFER_TOO_SMALL => Status::BufferTooSmall,
            sys::DZ_ERR_INTERNAL => Status::Internal,
            other => Status::Other(other),
        }
    }
    /// The C value.
    pub fn code(self) -> i32 {
        match self {
            Status::InvalidArgument => sys::DZ_ERR_INVALID_ARGUMENT,
            Status::Io => sys::DZ_ERR_IO,
            Status::Format => sys::DZ_ERR_FORMAT,
            Status::Unsupported => sys::DZ_ERR_UNSUPPORTED,
            Status::OutOfMemory => sys::DZ_ERR_OUT_OF_MEMORY,
            Status::KvFull => sys::DZ_ERR_KV_FULL,
            Status::Cancelled => sys::DZ_ERR_CANCELLED,
            Status::Device => sys::DZ_ERR_DEVICE,
            Status::NotFound => sys::DZ_ERR_NOT_FOUND,
            Status::BufferTooSmall => sys::DZ_ERR_BUFFER_TOO_SMALL,
            Status::Internal => sys::DZ_ERR_INTERNAL,
            Status::Other(c) => c,
        }
    }
    /// The C name ("DZ_ERR_IO").
    pub fn name(self) -> &'static str {
        unsafe { CStr::from_ptr(sys::dz_status_name(self.code())) }
            .to_str()
            .unwrap_or("DZ_ERR_UNKNOWN")
    }
}

/// A failing call: its status and the library's message (`dz_last_error`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status.name(), self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

fn check(st: sys::dz_status) -> Result<()> {
    if st == sys::DZ_OK {
        return Ok(());
    }
    // The message is thread-local; Rust calls stay on the calling thread.
    let msg = unsafe { sys::dz_last_error() };
    let message = if msg.is_null() {
        String::new()
    } else {
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    };
    Err(Error {
        status: Status::from_c(st),
        message,
    })
}

/// A C params/info struct holding the library's defaults. `init_sized` (a
/// `dz_*_init_sized`) is given the size of the struct as dayzero-sys declares
/// it, so a newer library whose struct has grown never writes past ours.
fn c_defaults<T>(init_sized: unsafe extern "C" fn(*mut T, usize)) -> T {
    let mut v = std::mem::MaybeUninit::<T>::zeroed();
    // SAFETY: T is one of dayzero-sys's #[repr(C)] params/info structs, for which
    // all zero bytes are valid; the call writes at most size_of::<T>() bytes.
    unsafe {
        init_sized(v.as_mut_ptr(), std::mem::size_of::<T>());
        v.assume_init()
    }
}

fn invalid(message: String) -> Error {
    Error {
        status: Status::InvalidArgument,
        message,
    }
}

fn cstring(s: &str, what: &str) -> Result<CString> {
    CString::new(s).map_err(|_| invalid(format!("{} contains a NUL byte", what)))
}

fn path_cstring(p: &Path) -> Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| invalid(format!("path {} contains a NUL byte", p.display())))
}

/// The loaded library's "MAJOR.MINOR.PATCH".
pub fn version() -> &'static str {
    unsafe { CStr::from_ptr(sys::dz_version()) }
        .to_str()
        .unwrap_or("")
}

/// The loaded library's ABI version; compare with [`sys::DZ_ABI_VERSION`].
pub fn abi_version() -> i32 {
    unsafe { sys::dz_abi_version() }
}

/// Log levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Debug = 0,
    Info = 1,
    Warn = 2,
    Error = 3,
    None = 4,
}

type LogFn = Box<dyn Fn(LogLevel, &str) + Send + Sync>;
static LOG: Mutex<Option<LogFn>> = Mutex::new(None);

unsafe extern "C" fn log_trampoline(
    level: sys::dz_log_level,
    message: *const c_char,
    _user: *mut c_void,
) {
    let level = match level {
        0 => LogLevel::Debug,
        1 => LogLevel::Info,
        2 => LogLevel::Warn,
        _ => LogLevel::Error,
    };
    let text = CStr::from_ptr(message).to_string_lossy();
    if let Ok(guard) = LOG.lock() {
        if let Some(f) = guard.as_ref() {
            f(level, &text);
        }
    }
}

/// Routes library log lines at or above `min_level` to `f` (`None`: stderr).
///
/// # Safety
/// The C API requires this to be called before other threads use the library.
pub unsafe fn set_log(f: Option<LogFn>, min_level: LogLevel) -> Result<()> {
    let has = f.is_some();
    *LOG.lock().unwrap() = f;
    let cb: sys::dz_log_fn = if has { Some(log_trampoline) } else { None };
    check(sys::dz_log_set(cb, ptr::null_mut(), min_level as c_int))
}

/// Backend choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu = 0,
    Cuda = 1,
    Auto = 2,
}

/// MoE expert precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Experts {
    Auto = 0,
    Native = 1,
    Fp8 = 2,
    Bf16 = 3,
}

/// Sparse-attention indexer precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Indexer {
    Exact = 0,
    Fp8 = 1,
    /// The backend's own: CPU exact, CUDA FP8.
    Auto = 2,
}

/// dz_model_params. `Default` gives the library's defaults.
#[derive(Debug, Clone)]
pub struct ModelParams {
    pub device: Device,
    pub device_index: i32,
    /// CPU threads, 0 = all cores.
    pub n_threads: i32,
    pub experts: Experts,
    pub indexer: Indexer,
    pub bf16_sensitive: bool,
}

impl Default for ModelParams {
    fn default() -> Self {
        ModelParams {
            device: Device::Cpu,
            device_index: 0,
            n_threads: 0,
            experts: Experts::Auto,
            indexer: Indexer::Auto,
            bf16_sensitive: true,
        }
    }
}

/// dz_model_info.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    pub architecture: String,
    pub n_layers: i32,
    pub n_vocab: i32,
    pub hidden_size: i32,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    pub n_experts: i32,
    pub n_experts_active: i32,
    pub max_context: i64,
    pub n_params: u64,
    pub weight_bytes: u64,
    pub device_bytes: u64,
    pub n_shards: i32,
}

/// An opened model directory.
pub struct Model {
    ptr: NonNull<sys::dz_model>,
    // dz_kv_arena_create takes the model non-const: one at a time.
    arena_lock: Mutex<()>,
}

// Immutable after open; every const-pointer call is thread-safe (dayzero.h).
unsafe impl Send for Model {}
unsafe impl Sync for Model {}

type ProgressFn<'f> = &'f mut dyn FnMut(&str, u64, u64) -> bool;

unsafe extern "C" fn progress_trampoline(
    stage: *const c_char,
    done: u64,
    total: u64,
    user: *mut c_void,
) -> c_int {
    let f = &mut *(user as *mut ProgressFn<'_>);
    let stage = CStr::from_ptr(stage).to_string_lossy();
    f(&stage, done, total) as c_int
}

impl Model {
    /// Opens a Hugging Face model directory.
    pub fn open(dir: impl AsRef<Path>, params: &ModelParams) -> Result<Model> {
        Self::open_impl(dir.as_ref(), params, None)
    }

    /// Opens with a progress callback `f(stage, done, total)`; returning true cancels.
    pub fn open_with_progress(
        dir: impl AsRef<Path>,
        params: &ModelParams,
        mut f: impl FnMut(&str, u64, u64) -> bool,
    ) -> Result<Model> {
        let mut f: ProgressFn<'_> = &mut f;
        Self::open_impl(dir.as_ref(), params, Some(&mut f))
    }

    fn open_impl(
        dir: &Path,
        params: &ModelParams,
        progress: Option<&mut ProgressFn<'_>>,
    ) -> Result<Model> {
        let cdir = path_cstring(dir)?;
        let mut p = c_defaults(sys::dz_model_params_init_sized);
        p.device = params.device as c_int;
        p.device_index = params.device_index;
        p.n_threads = params.n_threads;
        p.experts = params.experts as c_int;
        p.indexer = params.indexer as c_int;
        p.bf16_sensitive = params.bf16_sensitive as c_int;
        if let Some(f) = progress {
            p.progress = Some(progress_trampoline);
            p.progress_user = f as *mut ProgressFn<'_> as *mut c_void;
        }
        let mut out = ptr::null_mut();
        check(unsafe { sys::dz_model_open(cdir.as_ptr(), &p, &mut out) })?;
        Ok(Model {
            ptr: NonNull::new(out).expect("dz_model_open returned DZ_OK and NULL"),
            arena_lock: Mutex::new(()),
        })
    }

    /// Describes the model.
    pub fn info(&self) -> Result<ModelInfo> {
        let mut i = c_defaults(sys::dz_model_info_init_sized);
        check(unsafe { sys::dz_model_get_info(self.ptr.as_ptr(), &mut i) })?;
        let arch = if i.architecture.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(i.architecture) }
                .to_string_lossy()
                .into_owned()
        };
        Ok(ModelInfo {
            architecture: arch,
            n_layers: i.n_layers,
            n_vocab: i.n_vocab,
            hidden_size: i.hidden_size,
            n_heads: i.n_heads,
            n_kv_heads: i.n_kv_heads,
            n_experts: i.n_experts,
            n_experts_active: i.n_experts_active,
            max_context: i.max_context,
            n_params: i.n_params,
            weight_bytes: i.weight_bytes,
            device_bytes: i.device_bytes,
            n_shards: i.n_shards,
        })
    }

    /// The model's tokenizer, or `None` when the directory has none.
    pub fn tokenizer(&self) -> Result<Option<Tokenizer<'_>>> {
        let mut out = ptr::null();
        match check(unsafe { sys::dz_model_tokenizer(self.ptr.as_ptr(), &mut out) }) {
            Ok(()) => Ok(NonNull::new(out as *mut _).map(|ptr| Tokenizer {
                ptr,
                owned: false,
                _owner: PhantomData,
            })),
            Err(e) if e.status == Status::NotFound || e.status == Status::Unsupported => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        unsafe { sys::dz_model_free(self.ptr.as_ptr()) }
    }
}

/// A tokenizer: from [`Tokenizer::open`] (owned) or [`Model::tokenizer`] (the model's).
pub struct Tokenizer<'m> {
    ptr: NonNull<sys::dz_tokenizer>,
    owned: bool,
    _owner: PhantomData<&'m Model>,
}

// Immutable after open; every const-pointer call is thread-safe (dayzero.h).
unsafe impl Send for Tokenizer<'_> {}
unsafe impl Sync for Tokenizer<'_> {}

fn grow_bytes(
    mut f: impl FnMut(*mut c_char, usize, &mut usize) -> sys::dz_status,
) -> Result<String> {
    let mut buf = vec![0u8; 256];
    loop {
        let mut n = 0usize;
        let st = f(buf.as_mut_ptr() as *mut c_char, buf.len(), &mut n);
        if st == sys::DZ_ERR_BUFFER_TOO_SMALL && n > buf.len() {
            buf.resize(n, 0);
            continue;
        }
        check(st)?;
        buf.truncate(n);
        return Ok(String::from_utf8_lossy(&buf).into_owned());
    }
}

impl Tokenizer<'static> {
    /// Opens a tokenizer.json (tokenizer_config.json beside it is read when present) or a tiktoken.model.
    pub fn open(path: impl AsRef<Path>) -> Result<Tokenizer<'static>> {
        let c = path_cstring(path.as_ref())?;
        let mut out = ptr::null_mut();
        check(unsafe { sys::dz_tokenizer_open(c.as_ptr(), &mut out) })?;
        Ok(Tokenizer {
            ptr: NonNull::new(out).expect("NULL tokenizer"),
            owned: true,
            _owner: PhantomData,
        })
    }
}

impl<'m> Tokenizer<'m> {
    /// Token ids of UTF-8 text; `parse_special` turns special-token text into its id.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<i32>> {
        let mut out = vec![0i32; text.len() + 8];
        loop {
            let mut n = 0usize;
            let st = unsafe {
                sys::dz_tokenize(
                    self.ptr.as_ptr(),
                    text.as_ptr() as *const c_char,
                    text.len(),
                    parse_special as c_int,
                    out.as_mut_ptr(),
                    out.len(),
                    &mut n,
                )
            };
            if st == sys::DZ_ERR_BUFFER_TOO_SMALL && n > out.len() {
                out.resize(n, 0);
                continue;
            }
            check(st)?;
            out.truncate(n);
            return Ok(out);
        }
    }

    /// Text of ids.
    pub fn decode(&self, ids: &[i32]) -> Result<String> {
        grow_bytes(|out, cap, n| unsafe {
            sys::dz_detokenize(self.ptr.as_ptr(), ids.as_ptr(), ids.len(), out, cap, n)
        })
    }

    /// Renders `messages_json` (a JSON array of {"role","content"}) through the chat template;
    /// `options_json`: extra template variables as a JSON object.
    pub fn apply_chat_template(
        &self,
        messages_json: &str,
        options_json: Option<&str>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let m = cstring(messages_json, "messages_json")?;
        let o = options_json
            .map(|o| cstring(o, "options_json"))
            .transpose()?;
        let optr = o.as_ref().map_or(ptr::null(), |o| o.as_ptr());
        grow_bytes(|out, cap, n| unsafe {
            sys::dz_chat_apply_template(
                self.ptr.as_ptr(),
                m.as_ptr(),
                optr,
                add_generation_prompt as c_int,
                out,
                cap,
                n,
            )
        })
    }

    pub fn vocab_size(&self) -> Result<i32> {
        let mut n = 0;
        check(unsafe { sys::dz_tokenizer_vocab_size(self.ptr.as_ptr(), &mut n) })?;
        Ok(n)
    }

    /// Id of a token's exact text; `None` when there is none.
    pub fn token_id(&self, text: &str) -> Result<Option<i32>> {
        let c = cstring(text, "token text")?;
        let mut id = 0;
        match check(unsafe { sys::dz_tokenizer_token_id(self.ptr.as_ptr(), c.as_ptr(), &mut id) }) {
            Ok(()) => Ok(Some(id)),
            Err(e) if e.status == Status::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Ids that end generation.
    pub fn stop_ids(&self) -> Result<Vec<i32>> {
        let mut p = ptr::null();
        let mut n = 0usize;
        check(unsafe { sys::dz_tokenizer_stop_ids(self.ptr.as_ptr(), &mut p, &mut n) })?;
        Ok(if n == 0 {
            Vec::new()
        } else {
            unsafe { std::slice::from_raw_parts(p, n) }.to_vec()
        })
    }

    /// A streaming decoder.
    pub fn detokenizer(&self) -> Result<Detokenizer<'_>> {
        let mut out = ptr::null_mut();
        check(unsafe { sys::dz_detokenizer_create(self.ptr.as_ptr(), &mut out) })?;
        Ok(Detokenizer {
            ptr: NonNull::new(out).expect("NULL detokenizer"),
            _tok: PhantomData,
        })
    }
}

impl Drop for Tokenizer<'_> {
    fn drop(&mut self) {
        if self.owned {
            unsafe { sys::dz_tokenizer_free(self.ptr.as_ptr()) }
        }
    }
}

/// Streaming decoder: every piece is valid UTF-8.
pub struct Detokenizer<'t> {
    ptr: NonNull<sys::dz_detokenizer>,
    _tok: PhantomData<&'t ()>,
}

// One thread at a time per handle (dayzero.h): Send, not Sync.
unsafe impl Send for Detokenizer<'_> {}

impl Detokenizer<'_> {
    /// Feeds one id; returns the text now complete (possibly "").
    pub fn push(&mut self, id: i32) -> Result<String> {
        let mut piece = ptr::null();
        let mut len = 0usize;
        check(unsafe { sys::dz_detokenizer_push(self.ptr.as_ptr(), id, &mut piece, &mut len) })?;
        if len == 0 {
            return Ok(String::new());
        }
        let bytes = unsafe { std::slice::from_raw_parts(piece as *const u8, len) };
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    /// End of stream: what `push` held back (an incomplete UTF-8 sequence as U+FFFD).
    pub fn flush(&mut self) -> Result<String> {
        let mut piece = ptr::null();
        let mut len = 0usize;
        check(unsafe { sys::dz_detokenizer_flush(self.ptr.as_ptr(), &mut piece, &mut len) })?;
        if len == 0 {
            return Ok(String::new());
        }
        let bytes = unsafe { std::slice::from_raw_parts(piece as *const u8, len) };
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }
}

impl Drop for Detokenizer<'_> {
    fn drop(&mut self) {
        unsafe { sys::dz_detokenizer_free(self.ptr.as_ptr()) }
    }
}

/// dz_kv_arena_params. `Default` gives the library's defaults.
#[derive(Debug, Clone)]
pub struct ArenaParams {
    pub page_tokens: u32,
    pub capacity_pages: u64,
    pub capacity_bytes: u64,
    pub max_sessions: u32,
    pub prefix_cache: bool,
}

impl Default for ArenaParams {
    fn default() -> Self {
        ArenaParams {
            page_tokens: 0,
            capacity_pages: 0,
            capacity_bytes: 0,
            max_sessions: 0,
            prefix_cache: true,
        }
    }
}

/// The paged KV pool of one model.
pub struct KvArena<'m> {
    ptr: NonNull<sys::dz_kv_arena>,
    model: &'m Model,
}

// Internally synchronised (dayzero.h).
unsafe impl Send for KvArena<'_> {}
unsafe impl Sync for KvArena<'_> {}

pub use sys::dz_kv_stats as KvStats;
pub use sys::dz_session_stats as SessionStats;

impl<'m> KvArena<'m> {
    pub fn new(model: &'m Model, params: &ArenaParams) -> Result<KvArena<'m>> {
        let mut p = c_defaults(sys::dz_kv_arena_params_init_sized);
        p.page_tokens = params.page_tokens;
        p.capacity_pages = params.capacity_pages;
        p.capacity_bytes = params.capacity_bytes;
        p.max_sessions = params.max_sessions;
        p.prefix_cache = params.prefix_cache as c_int;
        let mut out = ptr::null_mut();
        {
            let _g = model.arena_lock.lock().unwrap_or_else(|e| e.into_inner());
            check(unsafe { sys::dz_kv_arena_create(model.ptr.as_ptr(), &p, &mut out) })?;
        }
        Ok(KvArena {
            ptr: NonNull::new(out).expect("NULL arena"),
            model,
        })
    }

    pub fn model(&self) -> &'m Model {
        self.model
    }

    pub fn stats(&self) -> Result<KvStats> {
        unsafe {
            let mut s: KvStats = c_defaults(sys::dz_kv_stats_init_sized);
            check(sys::dz_kv_arena_get_stats(self.ptr.as_ptr(), &mut s))?;
            Ok(s)
        }
    }
}

impl Drop for KvArena<'_> {
    fn drop(&mut self) {
        unsafe { sys::dz_kv_arena_free(self.ptr.as_ptr()) }
    }
}

/// dz_sampler_params. `Default` is greedy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampler {
    /// <= 0: greedy.
    pub temperature: f32,
    /// 0: off.
    pub top_k: i32,
    /// 1: off.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for Sampler {
    fn default() -> Self {
        Sampler {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl Sampler {
    fn to_c(self) -> sys::dz_sampler_params {
        let mut p = c_defaults(sys::dz_sampler_params_init_sized);
        p.temperature = self.temperature;
        p.top_k = self.top_k;
        p.top_p = self.top_p;
        p.seed = self.seed;
        p
    }
}

/// dz_session_params.
#[derive(Debug, Clone, Default)]
pub struct SessionParams {
    pub sampler: Sampler,
    /// Tokens per prefill micro-batch, 0 = the library's choice.
    pub prefill_chunk: u32,
    /// Set it to true (from any thread) to stop a running call between layers
    /// with [`Status::Cancelled`]; the session stays unchanged.
    pub abort: Option<Arc<AtomicBool>>,
}

unsafe extern "C" fn abort_trampoline(user: *mut c_void) -> c_int {
    (*(user as *const AtomicBool)).load(Ordering::Relaxed) as c_int
}

/// Which appended tokens get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsMode {
    Last = 0,
    All = 1,
}

/// Logits of the last append, borrowed from the session: `rows` x `n_vocab`, row-major.
#[derive(Debug, Clone, Copy)]
pub struct Logits<'s> {
    pub rows: usize,
    pub n_vocab: usize,
    pub data: &'s [f32],
}

impl<'s> Logits<'s> {
    pub fn row(&self, i: usize) -> &'s [f32] {
        &self.data[i * self.n_vocab..(i + 1) * self.n_vocab]
    }
}

/// One sequence in a [`KvArena`].
pub struct Session<'a> {
    ptr: NonNull<sys::dz_session>,
    arena: &'a KvArena<'a>,
    // Kept alive for the C abort callback, which points into it.
    abort: Option<Arc<AtomicBool>>,
}

// One thread at a time per session (dayzero.h): Send, not Sync.
unsafe impl Send for Session<'_> {}

impl<'a> Session<'a> {
    pub fn new(arena: &'a KvArena<'a>, params: &SessionParams) -> Result<Session<'a>> {
        let mut p = c_defaults(sys::dz_session_params_init_sized);
        p.sampler = params.sampler.to_c();
        p.prefill_chunk = params.prefill_chunk;
        if let Some(flag) = &params.abort {
            p.abort = Some(abort_trampoline);
            p.abort_user = Arc::as_ptr(flag) as *mut c_void;
        }
        let mut out = ptr::null_mut();
        check(unsafe { sys::dz_session_create(arena.ptr.as_ptr(), &p, &mut out) })?;
        Ok(Session {
            ptr: NonNull::new(out).expect("NULL session"),
            arena,
            abort: params.abort.clone(),
        })
    }

    pub fn arena(&self) -> &'a KvArena<'a> {
        self.arena
    }

    /// A copy sharing this session's pages copy-on-write.
    pub fn fork(&self) -> Result<Session<'a>> {
        let mut out = ptr::null_mut();
        check(unsafe { sys::dz_session_fork(self.ptr.as_ptr(), &mut out) })?;
        Ok(Session {
            ptr: NonNull::new(out).expect("NULL session"),
            arena: self.arena,
            abort: self.abort.clone(),
        })
    }

    /// Appends tokens and runs the model over them. On failure the session is unchanged.
    pub fn append(&mut self, tokens: &[i32], mode: LogitsMode) -> Result<()> {
        check(unsafe {
            sys::dz_session_append(
                self.ptr.as_ptr(),
                tokens.as_ptr(),
                tokens.len(),
                mode as c_int,
            )
        })
    }

    /// The last append's logits, borrowed until the session changes.
    pub fn logits(&self) -> Result<Logits<'_>> {
        let mut p = ptr::null();
        let (mut rows, mut nv) = (0usize, 0usize);
        check(unsafe { sys::dz_session_logits(self.ptr.as_ptr(), &mut p, &mut rows, &mut nv) })?;
        let data = if rows * nv == 0 {
            &[][..]
        } else {
            unsafe { std::slice::from_raw_parts(p, rows * nv) }
        };
        Ok(Logits {
            rows,
            n_vocab: nv,
            data,
        })
    }

    /// Samples the next id from the last logits row without appending it.
    pub fn sample(&mut self) -> Result<i32> {
        let mut t = 0;
        check(unsafe { sys::dz_session_sample(self.ptr.as_ptr(), &mut t) })?;
        Ok(t)
    }

    pub fn set_sampler(&mut self, sampler: Sampler) -> Result<()> {
        let p = sampler.to_c();
        check(unsafe { sys::dz_session_set_sampler(self.ptr.as_ptr(), &p) })
    }

    /// Tokens in the sequence.
    pub fn len(&self) -> Result<usize> {
        let mut n = 0usize;
        check(unsafe { sys::dz_session_length(self.ptr.as_ptr(), &mut n) })?;
        Ok(n)
    }

    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Keeps the first n tokens.
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        check(unsafe { sys::dz_session_truncate(self.ptr.as_ptr(), n) })
    }

    pub fn reset(&mut self) -> Result<()> {
        check(unsafe { sys::dz_session_reset(self.ptr.as_ptr()) })
    }

    pub fn stats(&self) -> Result<SessionStats> {
        unsafe {
            let mut s: SessionStats = c_defaults(sys::dz_session_stats_init_sized);
            check(sys::dz_session_get_stats(self.ptr.as_ptr(), &mut s))?;
            Ok(s)
        }
    }

    /// Samples the next id, appends it and computes its logits.
    pub fn step(&mut self) -> Result<i32> {
        Ok(generate_step(&mut [self])?[0])
    }

    /// Appends `prompt`, then streams up to `max_tokens` generated tokens. Generation ends after a
    /// stop id (`stop`, or with `None` the model tokenizer's stop ids), which is not yielded.
    /// Each token carries its text when the model has a tokenizer.
    pub fn generate<'s>(
        &'s mut self,
        prompt: &[i32],
        max_tokens: usize,
        stop: Option<&[i32]>,
    ) -> Result<Generate<'s, 'a>> {
        let tok = self.arena.model.tokenizer()?;
        let stop = match (stop, &tok) {
            (Some(s), _) => s.to_vec(),
            (None, Some(t)) => t.stop_ids()?,
            (None, None) => Vec::new(),
        };
        let detok = match &tok {
            Some(t) => {
                let mut out = ptr::null_mut();
                check(unsafe { sys::dz_detokenizer_create(t.ptr.as_ptr(), &mut out) })?;
                Some(Detokenizer {
                    ptr: NonNull::new(out).expect("NULL detokenizer"),
                    _tok: PhantomData,
                })
            }
            None => None,
        };
        if !prompt.is_empty() {
            self.append(prompt, LogitsMode::Last)?;
        }
        Ok(Generate {
            session: self,
            left: max_tokens,
            stop,
            detok,
        })
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        unsafe { sys::dz_session_free(self.ptr.as_ptr()) }
    }
}

/// A generated token: its id and, when the model has a tokenizer, the text it completes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    pub id: i32,
    pub text: Option<String>,
}

/// Streaming generation: an iterator of tokens, each produced when `next` is called.
pub struct Generate<'s, 'a> {
    session: &'s mut Session<'a>,
    left: usize,
    stop: Vec<i32>,
    detok: Option<Detokenizer<'a>>,
}

impl Iterator for Generate<'_, '_> {
    type Item = Result<Token>;
    fn next(&mut self) -> Option<Result<Token>> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let id = match self.session.step() {
            Ok(id) => id,
            Err(e) => {
                self.left = 0;
                return Some(Err(e));
            }
        };
        if self.stop.contains(&id) {
            self.left = 0;
            return None;
        }
        let text = match self.detok.as_mut().map(|d| d.push(id)).transpose() {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        Some(Ok(Token { id, text }))
    }
}

/// One decode step for sessions of one arena (continuous batching): each samples its next id,
/// appends it and computes its logits.
pub fn generate_step(sessions: &mut [&mut Session<'_>]) -> Result<Vec<i32>> {
    let ptrs: Vec<*mut sys::dz_session> = sessions.iter().map(|s| s.ptr.as_ptr()).collect();
    let mut out = vec![0i32; ptrs.len()];
    check(unsafe { sys::dz_generate_step(ptrs.as_ptr(), ptrs.len(), out.as_mut_ptr()) })?;
    Ok(out)
}

/// Appends `tokens[i]` to `sessions[i]`, batched (forced decoding).
pub fn decode_batch(sessions: &mut [&mut Session<'_>], tokens: &[i32]) -> Result<()> {
    if sessions.len() != tokens.len() {
        return Err(invalid(format!(
            "decode_batch: {} sessions, {} tokens",
            sessions.len(),
            tokens.len()
        )));
    }
    let ptrs: Vec<*mut sys::dz_session> = sessions.iter().map(|s| s.ptr.as_ptr()).collect();
    check(unsafe { sys::dz_decode_batch(ptrs.as_ptr(), tokens.as_ptr(), ptrs.len()) })
}
