//! The safe API against the tiny fixture model; generation is compared with
//! the C API's tokens from the C example program run on the same prompt.
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use dayzero::{
    generate_step, ArenaParams, KvArena, LogitsMode, Model, ModelParams, Session, SessionParams,
    Status,
};

const PROMPT: [i32; 6] = [2, 17, 300, 45, 8, 99];
const N_GEN: usize = 8;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{} is not set (ctest sets it; see tests/bindings.cmake)",
            name
        )
    })
}

type Reference = (Vec<i32>, Option<Vec<u8>>);

/// (ids, text bytes) the C example program prints for `prompt` on `model`, computed once per input:
/// every process loading libdayzero costs start-up time.
fn reference(model: &str, prompt: &[i32], n: usize) -> Reference {
    static CACHE: Mutex<Vec<((String, Vec<i32>, usize), Reference)>> = Mutex::new(Vec::new());
    let key = (model.to_string(), prompt.to_vec(), n);
    let mut c = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, r)) = c.iter().find(|(k, _)| *k == key) {
        return r.clone();
    }
    let r = run_reference(model, prompt, n);
    c.push((key, r.clone()));
    r
}

fn reference_ids() -> Vec<i32> {
    reference(&env("DAYZERO_TEST_MODEL"), &PROMPT, N_GEN).0
}

fn run_reference(model: &str, prompt: &[i32], n: usize) -> Reference {
    let mut cmd = Command::new(env("DAYZERO_TEST_REFERENCE"));
    cmd.arg(model).arg(n.to_string());
    for id in prompt {
        cmd.arg(id.to_string());
    }
    let out = cmd.output().expect("cannot run the reference program");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "reference program failed:\n{}", text);
    let line = text
        .lines()
        .find(|l| l.starts_with("generated:"))
        .unwrap_or_else(|| panic!("no ids in:\n{}", text));
    let ids: Vec<i32> = line["generated:".len()..]
        .split_whitespace()
        .map(|s| s.parse().unwrap())
        .collect();
    assert_eq!(ids.len(), n, "{}", text);
    // "text: " is the last line; the text itself may hold newlines.
    let marker = b"\ntext: ";
    let streamed = out
        .stdout
        .windows(marker.len())
        .position(|w| w == marker)
        .map(|i| out.stdout[i + marker.len()..out.stdout.len() - 1].to_vec());
    (ids, streamed)
}

/// A small KV arena: quick to set up.
fn small() -> ArenaParams {
    ArenaParams {
        capacity_bytes: 8 << 20,
        ..Default::default()
    }
}

fn open() -> Model {
    Model::open(env("DAYZERO_TEST_MODEL"), &ModelParams::default()).expect("open the tiny model")
}

#[test]
fn version_matches_the_header() {
    let v = format!(
        "{}.{}.{}",
        dayzero_sys::DZ_VERSION_MAJOR,
        dayzero_sys::DZ_VERSION_MINOR,
        dayzero_sys::DZ_VERSION_PATCH
    );
    assert_eq!(dayzero::version(), v);
    assert_eq!(dayzero::abi_version(), dayzero_sys::DZ_ABI_VERSION);
}

#[test]
fn bad_path_gives_status_and_message() {
    let dir = std::env::temp_dir().join("dayzero-no-such-model");
    let err = Model::open(&dir, &ModelParams::default())
        .err()
        .expect("opening a missing folder succeeded");
    assert_eq!(err.status, Status::Io);
    assert!(
        err.message.contains(dir.to_str().unwrap()),
        "message does not name the path: {}",
        err.message
    );
    assert!(err.to_string().starts_with("DZ_ERR_IO: "), "{}", err);
}

#[test]
fn greedy_generation_matches_the_c_api() {
    let want = reference_ids();
    let model = open();
    let info = model.info().unwrap();
    assert_eq!(info.architecture, "gpt_oss");
    let arena = KvArena::new(&model, &small()).unwrap();
    let mut s = Session::new(&arena, &SessionParams::default()).unwrap();
    let got: Vec<i32> = s
        .generate(&PROMPT, N_GEN, Some(&[]))
        .unwrap()
        .map(|t| t.unwrap().id)
        .collect();
    assert_eq!(got, want, "greedy ids differ from the C API's");
    assert_eq!(s.len().unwrap(), PROMPT.len() + N_GEN);

    // The logits of the prompt: the greedy pick is their argmax.
    s.reset().unwrap();
    s.append(&PROMPT, LogitsMode::Last).unwrap();
    let l = s.logits().unwrap();
    assert_eq!((l.rows, l.n_vocab), (1, info.n_vocab as usize));
    let row = l.row(0);
    let argmax = (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b });
    assert_eq!(argmax as i32, want[0]);

    // A fork continues like its parent; a batched step matches.
    let mut f = s.fork().unwrap();
    let ids = generate_step(&mut [&mut s, &mut f]).unwrap();
    assert_eq!(ids, vec![want[0], want[0]]);
}

#[test]
fn abort_flag_cancels_and_leaves_the_session_unchanged() {
    let model = open();
    let arena = KvArena::new(&model, &small()).unwrap();
    let flag = Arc::new(AtomicBool::new(true));
    let params = SessionParams {
        abort: Some(flag.clone()),
        ..Default::default()
    };
    let mut s = Session::new(&arena, &params).unwrap();
    let err = s.append(&PROMPT, LogitsMode::Last).unwrap_err();
    assert_eq!(err.status, Status::Cancelled, "{}", err);
    assert_eq!(s.len().unwrap(), 0);
    flag.store(false, Ordering::Relaxed);
    s.append(&PROMPT, LogitsMode::Last).unwrap();
    assert_eq!(s.len().unwrap(), PROMPT.len());
}

#[test]
fn sessions_run_on_other_threads() {
    // Model and arena are Sync; sessions are Send: one per thread, same arena.
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Model>();
    send_sync::<KvArena<'static>>();
    send::<Session<'static>>();
    let want = reference_ids();
    let model = open();
    let arena = KvArena::new(&model, &small()).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(|| {
                    let mut s = Session::new(&arena, &SessionParams::default()).unwrap();
                    s.generate(&PROMPT, N_GEN, Some(&[]))
                        .unwrap()
                        .map(|t| t.unwrap().id)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), want);
        }
    });
}

#[test]
fn text_generation_streams_the_c_api_text() {
    let dir = env("DAYZERO_TEST_TEXT_MODEL");
    let model = Model::open(&dir, &ModelParams::default()).unwrap();
    let tok = model
        .tokenizer()
        .unwrap()
        .expect("the text model has a tokenizer");
    let ids = tok.encode("hello there", false).unwrap();
    assert_eq!(ids.len(), 4);
    assert_eq!(tok.token_id("hello").unwrap(), Some(ids[0]));
    assert_eq!(tok.token_id("no such token").unwrap(), None);
    assert_eq!(tok.decode(&ids).unwrap(), "hello there");
    assert!(tok.stop_ids().unwrap().contains(&500));
    let chat = tok
        .apply_chat_template(r#"[{"role":"user","content":"hi"}]"#, None, true)
        .unwrap();
    assert_eq!(chat, "<|start|>user<|message|>hi<|end|><|start|>assistant");
    let (want, want_text) = reference(&dir, &ids, 12);
    let arena = KvArena::new(&model, &small()).unwrap();
    let mut s = Session::new(&arena, &SessionParams::default()).unwrap();
    let tokens: Vec<_> = s
        .generate(&ids, 12, Some(&[]))
        .unwrap()
        .map(|t| t.unwrap())
        .collect();
    assert_eq!(tokens.iter().map(|t| t.id).collect::<Vec<_>>(), want);
    let text: String = tokens.iter().map(|t| t.text.clone().unwrap()).collect();
    assert_eq!(
        Some(text.into_bytes()),
        want_text,
        "streamed text differs from the C API's detokenizer"
    );
}
