//! The declarations in src/lib.rs must say what include/dayzero.h says.
//!
//! This test parses the header (comments and the preprocessor stripped), turns
//! every function, struct, opaque handle, enum, callback typedef and version
//! macro into the Rust declaration it must have, and checks that src/lib.rs
//! holds exactly those (compared without whitespace), nothing more. A second
//! test compares each params struct's size with the size the library's
//! *_init function writes into struct_size, and checks that *_init_sized
//! writes nothing past the size it is given.
use std::collections::BTreeSet;
use std::path::PathBuf;

fn header_path() -> PathBuf {
    match std::env::var_os("DAYZERO_HEADER") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../include/dayzero.h"),
    }
}

fn read(p: &PathBuf) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("cannot read {}: {}", p.display(), e))
}

fn strip_comments(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("/*") {
        out.push_str(&rest[..i]);
        let j = rest[i..].find("*/").expect("unterminated comment") + i + 2;
        rest = &rest[j..];
    }
    out.push_str(rest);
    out
}

fn squash(s: &str) -> String {
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    s.replace(",)", ")").replace(",}", "}").replace(",>", ">")
}

/// The Rust type of a C type; `decl` is a declaration like "const char **out".
/// Returns (name, rust type).
fn c_decl(decl: &str) -> (String, String) {
    let decl = decl.trim();
    // Split off the name: the last identifier.
    let name_start = decl
        .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
        .map(|i| i + 1)
        .unwrap_or(0);
    let (ty, name) = decl.split_at(name_start);
    (name.to_string(), c_type(ty))
}

fn c_type(ty: &str) -> String {
    // quals[0]: the base is const; quals[i]: `const` follows the i-th `*`.
    let spaced = ty.replace('*', " * ");
    let mut words = spaced.split_whitespace().peekable();
    let mut quals = vec![false];
    let mut base = String::new();
    while let Some(w) = words.next() {
        match w {
            "const" => *quals.last_mut().unwrap() = true,
            "*" => quals.push(false),
            _ => {
                assert!(base.is_empty(), "two base types in '{}'", ty);
                base = w.to_string();
            }
        }
    }
    let nptr = quals.len() - 1;
    let mut t = match base.as_str() {
        "void" if nptr == 0 => "()".to_string(),
        "void" => "c_void".to_string(),
        "char" => "c_char".to_string(),
        "int" => "c_int".to_string(),
        "float" => "f32".to_string(),
        "size_t" => "usize".to_string(),
        "int32_t" => "i32".to_string(),
        "uint32_t" => "u32".to_string(),
        "int64_t" => "i64".to_string(),
        "uint64_t" => "u64".to_string(),
        b if b.starts_with("dz_") => b.to_string(),
        b => panic!("unmapped C type '{}' in '{}'", b, ty),
    };
    for q in quals.iter().take(nptr) {
        t = format!("{}{}", if *q { "*const " } else { "*mut " }, t);
    }
    t
}

fn rust_param(p: &str) -> String {
    let (name, ty) = c_decl(p);
    let name =
        if ["fn", "type", "ref", "mod", "move", "in", "match", "use"].contains(&name.as_str()) {
            format!("{}_", name)
        } else {
            name
        };
    format!("{}: {}", name, ty)
}

fn rust_params(params: &str) -> String {
    let params = params.trim();
    if params == "void" || params.is_empty() {
        return String::new();
    }
    params
        .split(',')
        .map(rust_param)
        .collect::<Vec<_>>()
        .join(", ")
}

fn ret(ty: &str) -> String {
    let t = c_type(ty);
    if t == "()" {
        String::new()
    } else {
        format!(" -> {}", t)
    }
}

/// `void (dz_f)(T *p)` -> `void dz_f(T *p)`: the header parenthesizes the names
/// of functions that a function-like macro of the same name stands in front of.
fn unparenthesize_name(decl: &str) -> String {
    if let Some(open) = decl.find('(') {
        if let Some(close) = decl[open..].find(')').map(|j| j + open) {
            let inner = &decl[open + 1..close];
            let is_name =
                !inner.is_empty() && inner.chars().all(|c| c.is_alphanumeric() || c == '_');
            if is_name && decl[close + 1..].trim_start().starts_with('(') {
                return format!("{}{}{}", &decl[..open], inner, &decl[close + 1..]);
            }
        }
    }
    decl.to_string()
}

/// Every declaration the header makes, as the Rust text it must appear as.
fn expected_from_header(h: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for line in h.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.len() == 3
            && w[0] == "#define"
            && (w[1].starts_with("DZ_VERSION_") || w[1] == "DZ_ABI_VERSION")
        {
            out.push((
                w[1].to_string(),
                format!("pub const {}: c_int = {};", w[1], w[2]),
            ));
        }
    }
    let mut s = strip_comments(h);
    // The C++ guards and the DZ_API macro block are not declarations.
    while let Some(i) = s.find("#ifdef __cplusplus") {
        let j = s[i..].find("#endif").unwrap() + i + 6;
        s.replace_range(i..j, "");
    }
    let s: String = s
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let mut n_decls = 0;
    for stmt in s
        .split(';')
        .map(|x| x.split_whitespace().collect::<Vec<_>>().join(" "))
    {
        if stmt.is_empty() {
            continue;
        }
        n_decls += 1;
        if let Some(rest) = stmt.strip_prefix("typedef enum ") {
            let name = rest.split_whitespace().next().unwrap().to_string();
            out.push((name.clone(), format!("pub type {} = c_int;", name)));
            let body = &rest[rest.find('{').unwrap() + 1..rest.find('}').unwrap()];
            for item in body.split(',') {
                let (k, v) = item
                    .split_once('=')
                    .unwrap_or_else(|| panic!("enum value without '=': {}", item));
                out.push((
                    k.trim().to_string(),
                    format!("pub const {}: {} = {};", k.trim(), name, v.trim()),
                ));
            }
        } else if let Some(rest) = stmt.strip_prefix("typedef struct ") {
            let name = rest.split_whitespace().next().unwrap().to_string();
            // Structs with bodies were split on their fields' ';': they are parsed below.
            if !rest.contains('{') {
                out.push((
                    name.clone(),
                    format!("pub struct {} {{ _private: [u8; 0], }}", name),
                ));
            }
        } else if let Some(rest) = stmt.strip_prefix("typedef ") {
            // Function pointer: typedef RET (*NAME)(PARAMS)
            let open = rest
                .find("(*")
                .unwrap_or_else(|| panic!("unknown typedef: {}", stmt));
            let close = rest[open..].find(')').unwrap() + open;
            let name = rest[open + 2..close].trim().to_string();
            let params = &rest[close + 1..];
            let params = &params[params.find('(').unwrap() + 1..params.rfind(')').unwrap()];
            out.push((
                name.clone(),
                format!(
                    "pub type {} = Option<unsafe extern \"C\" fn({}){}>;",
                    name,
                    rust_params(params),
                    ret(&rest[..open])
                ),
            ));
        } else if let Some(rest) = stmt.strip_prefix("DZ_API ") {
            let rest = unparenthesize_name(rest);
            let open = rest.find('(').unwrap();
            let (ret_ty_name, params) = rest.split_at(open);
            let (name, _) = c_decl(ret_ty_name);
            let ret_ty = &ret_ty_name[..ret_ty_name.len() - name.len()];
            let params = &params[1..params.rfind(')').unwrap()];
            out.push((
                name.clone(),
                format!("pub fn {}({}){};", name, rust_params(params), ret(ret_ty)),
            ));
        }
    }
    assert!(
        n_decls > 50,
        "parsed only {} declarations from the header",
        n_decls
    );
    // Structs with bodies: parse them from the comment-free text, fields split on ';'.
    let mut rest = s.as_str();
    while let Some(i) = rest.find("typedef struct ") {
        let after = &rest[i + "typedef struct ".len()..];
        let name = after.split_whitespace().next().unwrap().to_string();
        let next_semi = after.find(';').unwrap();
        match after.find('{') {
            Some(b) if b < next_semi => {
                let end = after.find('}').unwrap();
                let fields: Vec<String> = after[b + 1..end]
                    .split(';')
                    .map(|f| f.split_whitespace().collect::<Vec<_>>().join(" "))
                    .filter(|f| !f.is_empty())
                    .map(|f| {
                        let (n, t) = c_decl(&f);
                        format!("pub {}: {},", n, t)
                    })
                    .collect();
                out.push((
                    name.clone(),
                    format!("pub struct {} {{ {} }}", name, fields.join(" ")),
                ));
                rest = &after[end..];
            }
            _ => rest = &after[next_semi..],
        }
    }
    out
}

/// Names declared by src/lib.rs: `pub fn`, `pub struct`, `pub const`, `pub type`.
fn declared_in_rust(src: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for kw in ["pub fn ", "pub struct ", "pub const ", "pub type "] {
        let mut rest = src;
        while let Some(i) = rest.find(kw) {
            rest = &rest[i + kw.len()..];
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap();
            names.insert(rest[..end].to_string());
        }
    }
    names
}

#[test]
fn declarations_match_the_header() {
    let header = read(&header_path());
    let lib_path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs");
    let lib = read(&lib_path);
    // Attributes and `//` comments do not take part in the comparison.
    let code: String = lib
        .lines()
        .map(|l| l.split("//").next().unwrap())
        .filter(|l| !l.trim_start().starts_with("#"))
        .collect::<Vec<_>>()
        .join("\n");
    let squashed = squash(&code);
    let expected = expected_from_header(&header);
    let mut problems = Vec::new();
    for (_, decl) in &expected {
        if !squashed.contains(&squash(decl)) {
            problems.push(format!("missing or different in src/lib.rs: {}", decl));
        }
    }
    let want: BTreeSet<String> = expected.iter().map(|(n, _)| n.clone()).collect();
    for name in declared_in_rust(&code) {
        if !want.contains(&name) {
            problems.push(format!(
                "src/lib.rs declares {} which the header does not",
                name
            ));
        }
    }
    // Every struct is #[repr(C)].
    for (name, decl) in &expected {
        if decl.starts_with("pub struct ") {
            let at = lib.find(&format!("pub struct {} ", name)).unwrap();
            let before = &lib[..at];
            let attrs: Vec<&str> = before
                .lines()
                .rev()
                .take_while(|l| l.trim_start().starts_with("#["))
                .collect();
            if !attrs.iter().any(|a| a.contains("#[repr(C)]")) {
                problems.push(format!("{} is not #[repr(C)]", name));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "src/lib.rs has drifted from {}:\n{}",
        header_path().display(),
        problems.join("\n")
    );
    let n_fns = expected
        .iter()
        .filter(|(_, d)| d.starts_with("pub fn"))
        .count();
    println!(
        "{} declarations checked ({} functions) against {}",
        expected.len(),
        n_fns,
        header_path().display()
    );
}

/// 1024 bytes of 0xAB, aligned for any params struct.
fn guarded() -> [u64; 128] {
    [0xABAB_ABAB_ABAB_ABAB; 128]
}

fn bytes_of(buf: &[u64; 128]) -> &[u8] {
    unsafe { std::slice::from_raw_parts(buf.as_ptr() as *const u8, 1024) }
}

#[test]
fn struct_sizes_match_the_library() {
    use dayzero_sys::*;
    use std::mem::{size_of, MaybeUninit};
    macro_rules! size_check {
        ($t:ty, $init:ident, $init_sized:ident, $last:ident) => {{
            // The unsized init writes the library's sizeof(T) into struct_size; give it room to spare.
            let mut full = guarded();
            unsafe { $init(full.as_mut_ptr() as *mut $t) };
            let full = bytes_of(&full);
            let head = size_of::<usize>();
            let written = usize::from_ne_bytes(full[..head].try_into().unwrap());
            assert_eq!(
                written,
                size_of::<$t>(),
                "sizeof({}) differs between C and Rust",
                stringify!($t)
            );
            // The sized init writes no byte past the size it is given: ours, or an older
            // declaration's (without its last field), whose bytes are the full init's.
            let last = {
                let u = MaybeUninit::<$t>::uninit();
                let base = u.as_ptr();
                unsafe { std::ptr::addr_of!((*base).$last) as usize - base as usize }
            };
            for n in [size_of::<$t>(), last] {
                let mut cut = guarded();
                unsafe { $init_sized(cut.as_mut_ptr() as *mut $t, n) };
                let cut = bytes_of(&cut);
                let struct_size = usize::from_ne_bytes(cut[..head].try_into().unwrap());
                assert_eq!(struct_size, n, "{} cut at {}", stringify!($t), n);
                assert!(
                    cut[n..].iter().all(|&b| b == 0xAB),
                    "{}({}) wrote past {} bytes",
                    stringify!($init_sized),
                    n,
                    n
                );
                assert_eq!(cut[head..n], full[head..n], "{} cut at {}", stringify!($t), n);
            }
        }};
    }
    size_check!(
        dz_model_params,
        dz_model_params_init,
        dz_model_params_init_sized,
        pass_tokens
    );
    size_check!(
        dz_model_info,
        dz_model_info_init,
        dz_model_info_init_sized,
        n_shards
    );
    size_check!(
        dz_kv_arena_params,
        dz_kv_arena_params_init,
        dz_kv_arena_params_init_sized,
        prefix_cache
    );
    size_check!(
        dz_kv_stats,
        dz_kv_stats_init,
        dz_kv_stats_init_sized,
        state_snapshots_used
    );
    size_check!(
        dz_sampler_params,
        dz_sampler_params_init,
        dz_sampler_params_init_sized,
        seed
    );
    size_check!(
        dz_session_params,
        dz_session_params_init,
        dz_session_params_init_sized,
        abort_user
    );
    size_check!(
        dz_session_stats,
        dz_session_stats_init,
        dz_session_stats_init_sized,
        attention_tokens_read
    );
}

#[test]
fn translator_self_check() {
    // The C-to-Rust type rules this test relies on.
    assert_eq!(c_type("const char *"), "*const c_char");
    assert_eq!(c_type("dz_session *const *"), "*const *mut dz_session");
    assert_eq!(c_type("const dz_tokenizer **"), "*mut *const dz_tokenizer");
    assert_eq!(c_type("void"), "()");
    assert_eq!(rust_params("void"), "");
    assert_eq!(rust_param("dz_log_fn fn"), "fn_: dz_log_fn");
    assert_eq!(
        unparenthesize_name("void (dz_x_init)(dz_x *p)"),
        "void dz_x_init(dz_x *p)"
    );
    assert_eq!(
        unparenthesize_name("void dz_x_init(dz_x *p)"),
        "void dz_x_init(dz_x *p)"
    );
}
