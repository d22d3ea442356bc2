"""Embedded word lists that the generated corpus and datasets draw from.

Plain data, kept apart from the code that uses it. Changing a list changes every asset built
from it, so bump the recipe versions in ``tokenizer.py`` / ``data.py`` when you edit one.
"""

from __future__ import annotations


def _words(text: str) -> list[str]:
    """The whitespace-separated words of ``text``, in order."""
    return text.split()


NAMES = _words(
    """
Natalia Weng Betty Julie James Albert Ken Alexis Tina Randy Joy Mark Sarah Liam Olivia Noah Emma
Ava Sophia Mia Lucas Ethan Mason Logan Harper Elijah Amelia Aiden Chloe Daniel Grace Henry Isla
Jack Leo Lily Maya Nora Owen Ruby Samuel Zoe Carlos Priya Wei Mei Hiro Yuki Omar Fatima Ivan Elena
Marco Sofia Diego Lucia Raj Anika Tom Kate Ben Rosa Paul Nina Adam Hannah Eric Julia Felix Clara
"""
)

NOUNS = _words(
    """
apple book car dog cat house tree river mountain city garden window door table chair computer
phone letter story song picture teacher student doctor farmer baker driver artist writer child
friend family school library market station bridge road forest ocean island village kitchen
office room bottle cup plate basket box bag shoe shirt hat coat ball toy game puzzle cookie cake
bread cheese egg milk juice tea coffee soup rice noodle pencil pen notebook paper map clock
lamp flower bird fish horse cow sheep chicken duck rabbit bicycle train plane boat ship bus
truck engine machine robot model network token dataset gradient batch layer tensor server client
question answer problem idea reason plan project report meeting lesson class test exam result
number minute hour day week month year morning evening night summer winter spring autumn
weather rain snow wind sun moon star sky cloud field farm shop store bank museum park beach
world life time way thing information system program language example government company group
part place case point fact hand eye head face money power health business service country area
community science research education energy nature culture society experience knowledge memory
quality value price product process method change development level order kind type form
structure function object file code error message request response user assistant word sentence
text image video sound voice light color shape size weight distance speed temperature history
air animal baby body brother sister mother father daughter son camera card chance choice church
corner course dinner dream election evidence factory film floor future goal ground guest hair
heart hospital hotel industry job key kid leader line list lunch member mind moment
mouth movie nation neck news page parent party period plant player policy population president
purpose radio record region rest rule scene season seat sense shoulder side sign skill
source space sport stage step strategy street subject success surface task team
technology television theory thought town trade unit university vacation version view
wall wave wood worker
"""
)

VERBS = _words(
    """
walk talk jump play work cook clean paint visit watch listen help learn open close start
finish carry move fix plant water count measure compare explain describe answer ask
call climb cross deliver enjoy fill follow gather handle hope invite join kick laugh like love
mark need offer order pack pick pull push reach repair return save share sort stack stay
train test tune load update check print travel wash wish wonder
want use show seem provide include continue believe happen appear consider expect
suggest create develop produce improve increase reduce allow require remember decide discover
prepare receive remain replace support accept achieve add agree apply arrive avoid collect connect
contain cover define depend design discuss enter exist express focus generate identify
imagine involve manage notice observe obtain perform predict protect prove publish raise record
reflect release remove report represent respond select serve solve store suppose translate vote
wait warn worry borrow celebrate dance decorate dress explore fold guess hurry iron knock
mix note obey pour practice pray promise rain relax rescue rest rush search shout
smile sneeze spell spray stamp study suffer surprise thank touch trust turn wave whisper
"""
)

IRREGULAR_PAST = {
    'buy': 'bought', 'bring': 'brought', 'catch': 'caught', 'drink': 'drank', 'drive': 'drove',
    'eat': 'ate', 'find': 'found', 'give': 'gave', 'go': 'went', 'grow': 'grew', 'hold': 'held',
    'keep': 'kept', 'know': 'knew', 'leave': 'left', 'make': 'made', 'meet': 'met', 'read': 'read',
    'ride': 'rode', 'run': 'ran', 'see': 'saw', 'sell': 'sold', 'send': 'sent', 'sing': 'sang',
    'sit': 'sat', 'sleep': 'slept', 'speak': 'spoke', 'spend': 'spent', 'swim': 'swam', 'take': 'took',
    'tell': 'told', 'think': 'thought', 'throw': 'threw', 'understand': 'understood', 'win': 'won',
    'write': 'wrote', 'draw': 'drew', 'fly': 'flew', 'forget': 'forgot', 'get': 'got', 'lose': 'lost',
    'become': 'became', 'choose': 'chose', 'feel': 'felt', 'teach': 'taught', 'build': 'built',
}  # fmt: skip

ADJECTIVES = _words(
    """
big small old new young happy sad quick slow bright dark warm cold hot cool quiet loud busy
clean dirty early late easy hard simple strong gentle kind brave clever careful friendly
beautiful tiny huge heavy light soft round square long short tall wide narrow deep fresh
sweet sour green blue red yellow purple orange white black golden silver wooden famous
important useful helpful curious patient honest polite calm proud lucky rich poor modern
ancient strange favorite perfect different similar large sharp smooth noisy empty full
good great possible available general public social local national natural human personal
financial medical political economic technical digital physical final main major basic common
certain clear complete correct current direct effective entire exact free global high low likely
real recent serious significant special specific standard true various whole wrong accurate
random complex efficient powerful reliable stable bitter brilliant cheap crazy delicious elegant
excited fancy fierce fluffy giant glorious grumpy handsome hungry icy jolly juicy lazy lovely
magnificent mysterious nervous obedient odd plain precious quaint scary shiny silly sleepy sparkling
splendid spotless tender thoughtful tidy ugly unusual upset victorious wild witty worried zealous
"""
)

ADVERBS = _words(
    """
quickly slowly carefully happily quietly loudly often always sometimes rarely never usually
finally suddenly together again almost already soon today yesterday tomorrow early later
"""
)

PLACES = _words(
    """
Paris London Tokyo Beijing Shanghai Berlin Rome Madrid Cairo Sydney Toronto Chicago Boston
Seattle Denver Lisbon Vienna Prague Dublin Oslo Seoul Mumbai Nairobi Lima Hangzhou Shenzhen
"""
)

TOPICS = _words(
    """
mathematics physics chemistry biology history geography music art literature philosophy
economics programming statistics astronomy medicine engineering language grammar poetry
"""
)

ZH_NAMES = _words('小明 小红 小华 小丽 李雷 韩梅梅 王芳 张伟 刘洋 陈静 杨帆 赵强 孙悦 周杰 吴磊 郑爽')

ZH_NOUNS = _words(
    """
苹果 书 汽车 小狗 小猫 房子 大树 河流 高山 城市 花园 窗户 桌子 椅子 电脑 手机 信 故事 歌曲 图片
老师 学生 医生 农民 司机 朋友 家人 学校 图书馆 市场 车站 桥 道路 森林 大海 岛屿 村庄 厨房 办公室
杯子 盘子 篮子 盒子 鞋子 衣服 帽子 玩具 游戏 蛋糕 面包 牛奶 果汁 茶 咖啡 米饭 面条 铅笔 本子
地图 时钟 台灯 鲜花 小鸟 鱼 马 牛 羊 鸡 鸭 兔子 自行车 火车 飞机 轮船 公交车 机器人 模型
数据 问题 答案 想法 计划 项目 报告 会议 课程 考试 结果 天气 太阳 月亮 星星 天空 云 公园 博物馆
世界 生活 时间 方法 信息 系统 程序 语言 例子 政府 公司 团体 地方 事实 眼睛 健康 服务 国家
社会 科学 研究 教育 能源 自然 文化 经验 知识 记忆 质量 价格 产品 过程 变化 发展 水平 结构
功能 文件 代码 错误 消息 请求 用户 助手 句子 文本 声音 颜色 形状 大小 重量 距离 速度 温度 历史
空气 动物 身体 哥哥 姐姐 妈妈 爸爸 女儿 儿子 相机 机会 选择 晚饭 梦想 工厂 电影 未来 目标
客人 头发 医院 酒店 工作 钥匙 孩子 领导 午饭 成员 新闻 父母 音乐 体育 技术 电视 理论 城镇
"""
)

ZH_VERBS = _words(
    """
喜欢 学习 阅读 写 画 唱 跑 走 吃 喝 买 卖 看 听 说 做 帮助 打扫 修理 参观 准备 完成 开始
讨论 解释 回答 整理 种植 收集 分享 记录 计算 比较 训练 测试 设计 制作 寻找 发现 照顾
使用 成为 显示 感觉 提供 包括 继续 相信 发生 出现 考虑 期待 建议 创造 开发 生产 改进 增加
减少 允许 需要 记得 决定 接受 保持 支持 实现 同意 应用 到达 避免 连接 控制 定义 进入
存在 表达 关注 生成 识别 想象 管理 注意 观察 获得 预测 保护 证明 发布 反映 代表 选择 解决
"""
)

ZH_ADJECTIVES = _words(
    """
大 小 新 旧 快乐 安静 热闹 干净 漂亮 聪明 勇敢 认真 友好 有趣 重要 简单 复杂 美丽 温暖 凉爽
好 伟大 可能 普通 公共 自然 重大 基本 常见 清楚 完整 正确 直接 有效 准确 随机 高效 强大 可靠
稳定 便宜 美味 优雅 兴奋 饥饿 懒惰 可爱 神秘 紧张 奇怪 珍贵 可怕 闪亮 傻 困 整洁 丑 不寻常
"""
)

ZH_TIMES = _words('今天 昨天 明天 早上 晚上 周末 去年 明年 上午 下午 春天 夏天 秋天 冬天')

ZH_PLACES = _words('北京 上海 杭州 深圳 广州 成都 西安 南京 武汉 重庆 苏州 天津')

EMOJI = _words('😀 🎉 🚀 ✨ 🌟 👍 📚 🍎 ☕ 🌈 🐱 🐶 ❤️ 🔥 ✅')
